"""HTTP overhead of flare-http: TTFT and ITL through the shim vs direct libflare_client, at
concurrency 1/4/16, in the same run against the same daemon.

    python benchmarks/http_overhead.py                    # builds the tiny CPU model and a daemon
    python benchmarks/http_overhead.py --bundle B --device cuda   # a daemon on a prepared bundle
    python benchmarks/http_overhead.py --socket S         # an already running daemon
    ... --out benchmarks/results/FILE.jsonl               # append the records (JSON lines)

The shim runs as its own process (`python -m libflare_client.http`, uvloop + httptools), as in
production. Both paths stream the same token-id prompt with min_tokens = max_tokens (fixed
length); the HTTP path uses /v1/completions with an httpx streaming client and a minimal SSE
parser, so the numbers are the shim's cost, not an SDK's. Rounds alternate direct/HTTP.
Prints one JSON object per measurement, then a table. Targets (issue 6): the shim adds
<= 1 ms to TTFT and <= 3% to ITL at concurrency 1 and 4.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from libflare_client import AsyncClient, SamplingParams  # noqa: E402

RESULTS: list[dict[str, Any]] = []


def emit(**rec: Any) -> None:
    RESULTS.append(rec)
    print(json.dumps(rec), flush=True)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start_daemon(
    work: Path, device: str, bundle: Path | None
) -> tuple[subprocess.Popen[bytes], Path]:
    """A daemon on `bundle`, or on the tiny model (prepared into `work` on first use)."""
    from prep.__main__ import main as prep_main
    from prep.tiny import make_tiny_checkpoint

    bundle = bundle or work / "tiny.bundle"
    if not (bundle / "manifest.json").is_file():
        ckpt = make_tiny_checkpoint(work / "tiny-qwen3", "qwen3")
        args = [str(ckpt), "--out", str(bundle), "--device", device, "--max-context", "1024"]
        assert prep_main([*args, "--prefill-chunk", "256", "--no-compile"]) == 0
    sock = work / "sock" / "flared.sock"
    cfg = work / "flared.toml"
    cfg.write_text(f'[engine]\ndevice = "{device}"\n')
    log = open(work / "flared.log", "wb")  # noqa: SIM115
    cmd = [
        sys.executable,
        "-m",
        "flared.cli",
        "run",
        str(bundle),
        "--socket",
        str(sock),
        "--config",
        str(cfg),
    ]
    return subprocess.Popen(cmd, env=env(), stdout=log, stderr=log), sock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_http(url: str, timeout_s: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            try:
                if (await c.get(url + "/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("flare-http did not become healthy")


def stats_of(ttfts: list[float], itls: list[float]) -> dict[str, float]:
    q = statistics.quantiles
    return {
        "ttft_ms_p50": statistics.median(ttfts) * 1e3,
        "ttft_ms_p90": q(ttfts, n=10)[-1] * 1e3 if len(ttfts) > 1 else ttfts[0] * 1e3,
        "itl_ms_p50": statistics.median(itls) * 1e3,
        "itl_ms_mean": statistics.fmean(itls) * 1e3,
        "itl_ms_p90": q(itls, n=10)[-1] * 1e3,
    }


async def one_direct(client: AsyncClient, prompt: list[int], n_tok: int, seed: int) -> Any:
    t0 = time.perf_counter()
    times: list[float] = []
    async for ev in client.stream(
        prompt,
        max_tokens=n_tok,
        min_tokens=n_tok,
        sampling=SamplingParams(temperature=1.0, seed=seed),
    ):
        if ev.token_ids:
            times.append(time.perf_counter())
    return t0, times


async def one_http(http: Any, url: str, prompt: list[int], n_tok: int, seed: int) -> Any:
    body = {
        "model": "flare",
        "prompt": prompt,
        "max_tokens": n_tok,
        "min_tokens": n_tok,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
    }
    t0 = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        buf = b""
        async for chunk in r.aiter_raw():
            buf += chunk
            while b"\n\n" in buf:
                frame, buf = buf.split(b"\n\n", 1)
                if frame.startswith(b"data: {"):
                    d = json.loads(frame[6:])
                    if d["choices"] and d["choices"][0]["text"]:
                        times.append(time.perf_counter())
    return t0, times


async def run(a: argparse.Namespace, sock: Path) -> None:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    shim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "libflare_client.http",
            "--socket",
            str(sock),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env(),
    )
    try:
        client = AsyncClient(sock)
        await client.wait_ready(timeout_s=120)
        await wait_http(url)
        prompt = [(7 * i + 3) % 200 + 10 for i in range(a.prompt_len)]
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            # warm both paths
            await asyncio.gather(*(one_direct(client, prompt, 8, i) for i in range(4)))
            await asyncio.gather(*(one_http(http, url, prompt, 8, i) for i in range(4)))
            for conc in a.concurrency:
                acc: dict[str, tuple[list[float], list[float]]] = {
                    "direct": ([], []),
                    "http": ([], []),
                }
                for rnd in range(a.rounds):
                    for path in ("direct", "http") if rnd % 2 == 0 else ("http", "direct"):
                        seeds = range(rnd * conc, rnd * conc + conc)
                        if path == "direct":
                            outs = await asyncio.gather(
                                *(one_direct(client, prompt, a.tokens, s) for s in seeds)
                            )
                        else:
                            outs = await asyncio.gather(
                                *(one_http(http, url, prompt, a.tokens, s) for s in seeds)
                            )
                        for t0, times in outs:
                            acc[path][0].append(times[0] - t0)
                            acc[path][1].extend(b - x for x, b in pairwise(times))
                res = {p: stats_of(*acc[p]) for p in acc}
                for p in acc:
                    emit(
                        kind="http_overhead",
                        path=p,
                        concurrency=conc,
                        tokens=a.tokens,
                        prompt_len=a.prompt_len,
                        requests=len(acc[p][0]),
                        **res[p],
                    )
                emit(
                    kind="http_overhead_delta",
                    concurrency=conc,
                    ttft_added_ms_p50=res["http"]["ttft_ms_p50"] - res["direct"]["ttft_ms_p50"],
                    itl_added_pct_p50=100
                    * (res["http"]["itl_ms_p50"] / res["direct"]["itl_ms_p50"] - 1),
                    itl_added_pct_mean=100
                    * (res["http"]["itl_ms_mean"] / res["direct"]["itl_ms_mean"] - 1),
                )
        await client.close()
    finally:
        shim.terminate()
        shim.wait(timeout=10)


def table() -> None:
    print(
        f"\n{'conc':>4} {'path':>6} {'ttft p50':>9} {'ttft p90':>9} {'itl p50':>8} "
        f"{'itl mean':>8} {'itl p90':>8}   (ms)"
    )
    for r in RESULTS:
        if r["kind"] == "http_overhead":
            print(
                f"{r['concurrency']:>4} {r['path']:>6} {r['ttft_ms_p50']:>9.3f} "
                f"{r['ttft_ms_p90']:>9.3f} {r['itl_ms_p50']:>8.3f} {r['itl_ms_mean']:>8.3f} "
                f"{r['itl_ms_p90']:>8.3f}"
            )
        else:
            print(
                f"{r['concurrency']:>4}  delta: TTFT +{r['ttft_added_ms_p50']:.3f} ms, "
                f"ITL {r['itl_added_pct_p50']:+.2f}% (p50) {r['itl_added_pct_mean']:+.2f}% "
                "(mean)"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", type=Path, help="a running daemon (else: one started here)")
    p.add_argument("--bundle", type=Path, help="prepared bundle for the daemon (else: tiny)")
    p.add_argument("--out", type=Path, help="append the records to this JSON-lines file")
    p.add_argument("--work", type=Path, help="work directory for the tiny daemon")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="tiny daemon's device")
    p.add_argument(
        "--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16]
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    a = p.parse_args()
    daemon = None
    sock = a.socket
    if sock is None:
        work = a.work or Path(tempfile.mkdtemp(prefix="flare-http-bench-"))
        work.mkdir(parents=True, exist_ok=True)
        daemon, sock = start_daemon(work, a.device, a.bundle)
    try:
        asyncio.run(run(a, sock))
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=30)
    if a.out is not None:
        import platform

        meta = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "device": a.device,
                "bundle": str(a.bundle or "tiny"), "rounds": a.rounds}  # fmt: skip
        with open(a.out, "a") as f:
            for r in RESULTS:
                f.write(json.dumps({**meta, **r}) + "\n")
    table()


if __name__ == "__main__":
    main()
