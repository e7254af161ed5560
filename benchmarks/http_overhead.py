"""HTTP overhead of flare-http: TTFT and ITL through the shim vs direct libflare_client, at
concurrency 1/4/16, in the same run against the same daemon.

    python benchmarks/http_overhead.py --bundle BUNDLE --out FILE.jsonl  # daemon + shim here
    python benchmarks/http_overhead.py                  # the tiny CPU model (regressions only)
    python benchmarks/http_overhead.py --socket S       # an already running daemon
    ... --ref-shim DIR     # also a shim running the code of another checkout, same rounds

The daemon (`flared run`, device from the bundle: `auto`) and the shim (`python -m
libflare_client.http`, uvloop + httptools, its own process as in production) are started here.
Both paths stream the same prompt with min_tokens = max_tokens (fixed length) and the same
seeds, so they produce the same tokens (batch-invariant sampling). APIs: `completions`
(token-id prompt, /v1/completions) and `chat` (messages, /v1/chat/completions; the daemon
renders and parses). The HTTP client is a minimal HTTP/1.1 one over keep-alive connections
with a minimal SSE parser (the shim's cost, not a client library's); both paths run in this
process on one event loop (uvloop when installed). A token arrives when an event with visible
output does (direct: text, or parsed content/reasoning/tool calls for chat; HTTP: a chunk
carrying them). Rounds alternate the path order. Besides latency, the shim's CPU time per streamed token is read from
/proc/PID/task/*/schedstat (ns): that figure is robust on a loaded machine, latency is not.
Prints one JSON object per measurement, then a table. Targets: the shim adds <= 1 ms to TTFT
and <= 3% to ITL at concurrency 1 and 4.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from libflare_client import AsyncClient, ConnectionLost, SamplingParams  # noqa: E402

RESULTS: list[dict[str, Any]] = []
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "keeps"]


def emit(**rec: Any) -> None:
    RESULTS.append(rec)
    print(json.dumps(rec), flush=True)


def env(repo: Path = REPO) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(repo) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start_daemon(
    work: Path, device: str, bundle: Path | None
) -> tuple[subprocess.Popen[bytes], Path]:
    """A daemon on `bundle`, or on the tiny model (prepared into `work` on first use)."""
    if bundle is None:
        from prep.__main__ import main as prep_main
        from prep.tiny import make_tiny_checkpoint

        bundle = work / "tiny.bundle"
        tiny_device = "cuda" if device == "cuda" else "cpu"
        if not (bundle / "manifest.json").is_file():
            ckpt = make_tiny_checkpoint(work / "tiny-qwen3", "qwen3")
            args = [str(ckpt), "--out", str(bundle), "--device", tiny_device]
            args += ["--max-context", "1024", "--prefill-chunk", "256", "--no-compile"]
            assert prep_main(args) == 0
        device = tiny_device
    sock = work / "sock" / "flared.sock"
    cfg = work / "flared.toml"
    cfg.write_text(f'[engine]\ndevice = "{device}"\n')
    log = open(work / "flared.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "flared.cli", "run", str(bundle), "--socket", str(sock),
           "--config", str(cfg)]  # fmt: skip
    return subprocess.Popen(cmd, env=env(), stdout=log, stderr=log), sock


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_ns(pid: int) -> int:
    """On-CPU time of every live thread of `pid` (schedstat's first field, in ns; 0 where the
    kernel has no schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended meanwhile
    return total


@dataclass
class ShimProc:
    """A flare-http process serving `sock`, running the code of checkout `repo`."""

    name: str
    repo: Path
    sock: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "libflare_client.http", "--socket", str(self.sock),
               "--port", str(self.port), "--log-level", "warning"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=env(self.repo), cwd=self.repo)

    async def wait(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, "flare-http exited"
            try:
                r, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.write(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
                status = await r.readline()
                w.close()
                if status.split()[1:2] == [b"200"]:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError(f"flare-http ({self.name}) did not become healthy")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@dataclass(frozen=True)
class Workload:
    api: str  # "completions" | "chat"
    prompt_ids: list[int]
    prompt_text: str
    tokens: int

    def direct_kwargs(self, seed: int) -> dict[str, Any]:
        kw: dict[str, Any] = dict(max_tokens=self.tokens, min_tokens=self.tokens,
                                  sampling=SamplingParams(temperature=1.0, seed=seed))  # fmt: skip
        if self.api == "chat":
            return {**kw, "messages": [{"role": "user", "content": self.prompt_text}]}
        return {**kw, "prompt_token_ids": self.prompt_ids}

    def http_body(self, seed: int) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = dict(model="flare", max_tokens=self.tokens, min_tokens=self.tokens,
                                    temperature=1.0, seed=seed, stream=True)  # fmt: skip
        if self.api == "chat":
            return "/v1/chat/completions", {
                **body,
                "messages": [{"role": "user", "content": self.prompt_text}],
            }
        return "/v1/completions", {**body, "prompt": self.prompt_ids}


def visible(ev: Any, api: str) -> bool:
    if api == "chat":
        return bool(ev.content or ev.reasoning or ev.tool_calls)
    return bool(ev.text)


async def one_direct(client: AsyncClient, w: Workload, seed: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    times: list[float] = []
    async for ev in client.stream(**w.direct_kwargs(seed)):
        if visible(ev, w.api):
            times.append(time.perf_counter())
    return t0, times


def frame_visible(d: dict[str, Any]) -> bool:
    if not d.get("choices"):
        return False
    ch = d["choices"][0]
    if "text" in ch:
        return bool(ch["text"])
    delta = ch.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


class RawHTTP:
    """A minimal HTTP/1.1 client for streamed POSTs over keep-alive connections: the request
    is written whole, the chunked response is read chunk by chunk. So little work per chunk
    that the HTTP path's figures are the shim's, not a client library's."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post_stream(self, path: str, body: dict[str, Any]) -> Any:
        """Yield the response body's chunks (the status must be 200)."""
        data = json.dumps(body).encode()
        req = (b"POST %b HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%b" % (path.encode(), len(data), data))  # fmt: skip
        status = b""
        if self.idle:  # the server may have closed an idle connection (keep-alive timeout)
            r, w = self.idle.pop()
            w.write(req)
            status = await r.readline()
        if not status:
            r, w = await asyncio.open_connection("127.0.0.1", self.port)
            w.write(req)
            status = await r.readline()
        assert status.split()[1] == b"200", status
        chunked = False
        while (line := await r.readline()) != b"\r\n":
            chunked |= line.lower().startswith(b"transfer-encoding: chunked")
        assert chunked, "a streamed response is chunked"
        while True:
            size = int(await r.readline(), 16)
            if size == 0:
                await r.readline()
                break
            yield (await r.readexactly(size + 2))[:-2]
        self.idle.append((r, w))

    def close(self) -> None:
        for _, w in self.idle:
            w.close()


async def one_http(http: RawHTTP, w: Workload, seed: int) -> tuple[float, list[float]]:
    path, body = w.http_body(seed)
    t0 = time.perf_counter()
    times: list[float] = []
    buf = b""
    async for chunk in http.post_stream(path, body):
        buf += chunk
        while b"\n\n" in buf:
            frame, buf = buf.split(b"\n\n", 1)
            if frame.startswith(b"data: {") and frame_visible(json.loads(frame[6:])):
                times.append(time.perf_counter())
    return t0, times


def stats_of(ttfts: list[float], itls: list[float]) -> dict[str, float]:
    q = statistics.quantiles
    return {
        "ttft_ms_p50": statistics.median(ttfts) * 1e3,
        "ttft_ms_p90": q(ttfts, n=10)[-1] * 1e3 if len(ttfts) > 1 else ttfts[0] * 1e3,
        "itl_ms_p50": statistics.median(itls) * 1e3,
        "itl_ms_mean": statistics.fmean(itls) * 1e3,
        "itl_ms_p90": q(itls, n=10)[-1] * 1e3,
        "itl_ms_p99": q(itls, n=100)[-1] * 1e3,
    }


@dataclass
class Acc:
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    cpu_ns: int = 0


async def round_of(
    path: str, conc: int, seeds: range, w: Workload, client: AsyncClient,
    shims: dict[str, ShimProc], https: dict[str, RawHTTP], acc: Acc,
) -> None:  # fmt: skip
    shim = shims.get(path)
    pid = shim.proc.pid if shim is not None and shim.proc is not None else 0
    cpu0 = cpu_ns(pid) if pid else 0
    if shim is None:
        outs = await asyncio.gather(*(one_direct(client, w, s) for s in seeds))
    else:
        outs = await asyncio.gather(*(one_http(https[path], w, s) for s in seeds))
        acc.cpu_ns += cpu_ns(pid) - cpu0
    for t0, times in outs:
        if not times:
            raise SystemExit(
                f"a {path} stream carried no text: every sampled id detokenized to nothing "
                "(does the tokenizer cover the model's vocabulary? see benchmarks/shapes.py "
                "--vocab)"
            )
        acc.ttfts.append(times[0] - t0)
        acc.itls.extend(b - x for x, b in pairwise(times))
        acc.tokens += len(times)


def report(w: Workload, conc: int, accs: dict[str, Acc]) -> None:
    res = {p: stats_of(a.ttfts, a.itls) for p, a in accs.items()}
    for p, a in accs.items():
        extra = {}
        if p != "direct" and a.cpu_ns > 0:
            extra["shim_cpu_us_per_token"] = a.cpu_ns / 1e3 / max(a.tokens, 1)
        emit(kind="http_overhead", api=w.api, path=p, concurrency=conc, tokens=w.tokens,
             prompt_len=len(w.prompt_ids), requests=len(a.ttfts), streamed=a.tokens,
             **res[p], **extra)  # fmt: skip
    d = res["direct"]
    for p in accs:
        if p == "direct":
            continue
        h = res[p]
        emit(kind="http_overhead_delta", api=w.api, path=p, concurrency=conc,
             ttft_added_ms_p50=h["ttft_ms_p50"] - d["ttft_ms_p50"],
             itl_added_pct_p50=100 * (h["itl_ms_p50"] / d["itl_ms_p50"] - 1),
             itl_added_pct_mean=100 * (h["itl_ms_mean"] / d["itl_ms_mean"] - 1))  # fmt: skip


async def wait_daemon(client: AsyncClient, daemon: Any, timeout_s: float, log: Path) -> None:
    """Until the daemon is ready; fails at once when the daemon we started exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        if daemon is not None and daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited ({daemon.returncode}); see {log}")
        try:
            await client.wait_ready(timeout_s=5)
            return
        except ConnectionLost:
            if time.monotonic() > deadline:
                raise


async def measure(
    a: argparse.Namespace, sock: Path, shims: dict[str, ShimProc], daemon: Any, work: Path
) -> None:
    client = AsyncClient(sock)
    await wait_daemon(client, daemon, a.ready_timeout_s, work / "flared.log")
    for s in shims.values():
        await s.wait()
    ids = [(7 * i + 3) % 200 + 10 for i in range(a.prompt_len)]
    text = " ".join(WORDS[i % len(WORDS)] for i in range(a.prompt_len))
    https = {name: RawHTTP(s.port) for name, s in shims.items()}
    paths = ["direct", *shims]
    for api in a.api:
        w = Workload(api, ids, text, a.tokens)
        warm = Workload(api, ids, text, 8)
        for p in paths:  # warm every path (connections, prefix cache, first compiles)
            await round_of(p, 4, range(4), warm, client, shims, https, Acc())
        for conc in a.concurrency:
            accs = {p: Acc() for p in paths}
            for rnd in range(a.rounds):
                for p in paths if rnd % 2 == 0 else paths[::-1]:
                    seeds = range(rnd * conc, rnd * conc + conc)
                    await round_of(p, conc, seeds, w, client, shims, https, accs[p])
            report(w, conc, accs)
    for h in https.values():
        h.close()
    await client.close()


def table() -> None:
    print(f"\n{'api':>11} {'conc':>4} {'path':>8} {'ttft p50':>9} {'itl p50':>8} {'itl mean':>8} "
          f"{'itl p99':>8} {'cpu/tok':>8}   (ms, us)")  # fmt: skip
    for r in RESULTS:
        if r["kind"] == "http_overhead":
            cpu = r.get("shim_cpu_us_per_token")
            print(f"{r['api']:>11} {r['concurrency']:>4} {r['path']:>8} {r['ttft_ms_p50']:>9.3f} "
                  f"{r['itl_ms_p50']:>8.3f} {r['itl_ms_mean']:>8.3f} {r['itl_ms_p99']:>8.3f} "
                  f"{'' if cpu is None else f'{cpu:8.1f}'}")  # fmt: skip
        else:
            print(f"{r['api']:>11} {r['concurrency']:>4} {r['path']:>8} delta: TTFT "
                  f"{r['ttft_added_ms_p50']:+.3f} ms, ITL {r['itl_added_pct_p50']:+.2f}% (p50) "
                  f"{r['itl_added_pct_mean']:+.2f}% (mean)")  # fmt: skip


def run_loop(main: Any) -> None:
    """uvloop when installed (the shim's loop too), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--socket", type=Path, help="a running daemon (else: one started here)")
    p.add_argument("--bundle", type=Path, help="prepared bundle for the daemon (else: tiny)")
    p.add_argument("--out", type=Path, help="append the records to this JSON-lines file")
    p.add_argument("--work", type=Path, help="work directory (socket, logs, tiny bundle)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="the daemon's device (auto: cuda when available)")  # fmt: skip
    p.add_argument("--ref-shim", type=Path, help="checkout whose flare-http runs as path 'ref'")
    p.add_argument("--api", type=lambda s: s.split(","), default=["completions", "chat"])
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[1, 4, 16])  # fmt: skip
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--note", default="", help="free text stored with every record")
    return p.parse_args()


def main() -> None:
    a = parse_args()
    daemon = None
    sock = a.socket
    work = a.work or Path(tempfile.mkdtemp(prefix="flare-http-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if sock is None:
        daemon, sock = start_daemon(work, a.device, a.bundle)
    shims = {"http": ShimProc("http", REPO, sock)}
    if a.ref_shim is not None:
        shims["ref"] = ShimProc("ref", a.ref_shim.resolve(), sock)
    try:
        for s in shims.values():
            s.start()
        run_loop(measure(a, sock, shims, daemon, work))
    finally:
        for s in shims.values():
            s.stop()
        if daemon is not None:
            daemon.terminate()
            daemon.wait(timeout=60)
    if a.out is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()  # fmt: skip
        meta = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "commit": commit,
                "device": a.device, "bundle": str(a.bundle or "tiny"), "rounds": a.rounds,
                "cpus": os.cpu_count(), "note": a.note}  # fmt: skip
        with open(a.out, "a") as f:
            for r in RESULTS:
                f.write(json.dumps({**meta, **r}) + "\n")
    table()


if __name__ == "__main__":
    main()
