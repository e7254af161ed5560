"""Per-token delivery overhead daemon -> client through the real daemon: ring vs socket transport,
at 1/4/64 concurrent streams, against the engine's own inter-token latency.

    python benchmarks/transport_daemon.py                       # tiny model, CPU (or --device)
    python benchmarks/transport_daemon.py BUNDLE --device cuda  # a real prepared bundle

Method, for each concurrency c (the same c seeded fixed-length requests each time):
  engine   the bundle's Engine in this process, a sink stamping every token as the engine thread
           emits it: the inter-token latency (ITL) with no daemon and no transport;
  ring     a `flared run BUNDLE` daemon, one AsyncClient session (transport "ring") streaming the c
           requests concurrently, every token stamped as the client's stream yields it;
  socket   the same through the same daemon with transport "socket"; rounds alternate.
Delivery overhead per token = client ITL - engine ITL (p50 and mean, ms and % of the engine's),
so it holds everything between the engine thread and the application: the daemon's loop, the
detokenizer lanes, encoding, the transport and the client SDK. Every row is the median over
--rounds rounds. The engine runs first and is shut down before the daemon starts (one GPU).

Prints one JSON line per measurement (appended to --out), then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS: list[dict[str, Any]] = []
OUT: list[Path] = []


def emit(**rec: Any) -> None:
    rec.update(cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2))
    RESULTS.append(rec)
    line = json.dumps(rec)
    print(line, flush=True)
    for f in OUT:
        with f.open("a") as fh:
            fh.write(line + "\n")


def tiny_bundle(work: Path, device: str, max_rows: int) -> Path:
    from prep.__main__ import main as prep_main
    from prep.tiny import make_tiny_checkpoint

    bundle = work / f"tiny-{device}.bundle"
    if not (bundle / "manifest.json").is_file():
        ckpt = make_tiny_checkpoint(work / "tiny-qwen3", "qwen3")
        caps = ",".join(str(1 << i) for i in range(max_rows.bit_length()) if 1 << i <= max_rows)
        args = [str(ckpt), "--out", str(bundle), "--device", device, "--max-context", "1024",
                "--prefill-chunk", "256", "--decode-capacities", caps, "--no-compile"]  # fmt: skip
        assert prep_main(args) == 0
    return bundle


def prompts(c: int, length: int) -> list[list[int]]:
    return [[(7 * i + 13 * j + 3) % 200 + 10 for j in range(length)] for i in range(c)]


def itl_stats(per_stream: list[list[float]]) -> dict[str, float]:
    # the first gap holds the prefill of the other streams; skip it
    itls = [b - a for times in per_stream for a, b in pairwise(times[1:])]
    return {"itl_ms_p50": 1e3 * statistics.median(itls), "itl_ms_mean": 1e3 * statistics.fmean(itls),
            "itl_ms_p99": 1e3 * sorted(itls)[int(0.99 * (len(itls) - 1))], "tokens": len(itls)}  # fmt: skip


def engine_round(eng: Any, c: int, tokens: int, plen: int, seed: int) -> dict[str, float]:
    from flared.engine.events import TokenEvent
    from flared.requests import SamplingParams

    times: list[list[float]] = [[] for _ in range(c)]
    left = threading.Semaphore(0)

    def sink_for(i: int) -> Any:
        def sink(ev: Any) -> None:
            if isinstance(ev, TokenEvent):
                times[i].extend([time.perf_counter()] * len(ev.tokens))
            else:
                left.release()

        return sink

    for i, p in enumerate(prompts(c, plen)):
        eng.submit(p, sink_for(i), max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                   sampling=SamplingParams(temperature=1.0, seed=seed + i))  # fmt: skip
    for _ in range(c):
        assert left.acquire(timeout=600), "the engine did not finish"
    return itl_stats(times)


async def client_round(client: Any, c: int, tokens: int, plen: int, seed: int) -> dict[str, float]:
    from libflare_client import SamplingParams

    async def one(i: int, p: list[int]) -> list[float]:
        out: list[float] = []
        async for ev in client.stream(p, max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                                      sampling=SamplingParams(temperature=1.0, seed=seed + i)):  # fmt: skip
            if ev.token_ids:
                out.extend([time.perf_counter()] * len(ev.token_ids))
        return out

    return itl_stats(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts(c, plen)))))


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def run_engine(bundle: Path, a: argparse.Namespace) -> dict[int, dict[str, float]]:
    from flared.llm_engine import Engine, EngineConfig

    eng = Engine(bundle, EngineConfig(device=a.device)).start()
    try:
        engine_round(eng, 4, 8, a.prompt_len, 0)  # warm-up
        out = {}
        for c in a.streams:
            rs = [engine_round(eng, c, a.tokens, a.prompt_len, 1000 * r) for r in range(a.rounds)]
            out[c] = median_of(rs)
            emit(bench="transport_daemon", path="engine", streams=c, **out[c])
        return out
    finally:
        eng.shutdown()


def start_daemon(bundle: Path, work: Path, device: str) -> tuple[subprocess.Popen[bytes], Path]:
    sock = work / "sock" / "flared.sock"
    cfg = work / "flared.toml"
    cfg.write_text(f'[engine]\ndevice = "{device}"\n')
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = (work / "flared.log").open("wb")
    cmd = [sys.executable, "-m", "flared.cli", "run", str(bundle), "--socket", str(sock),
           "--config", str(cfg)]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=log), sock


async def run_daemon(sock: Path, a: argparse.Namespace, base: dict[int, dict[str, float]]) -> None:
    from libflare_client import AsyncClient

    clients = {t: AsyncClient(sock, transport=t, liveness_timeout_s=60) for t in ("ring", "socket")}
    await clients["ring"].wait_ready(timeout_s=600)
    for client in clients.values():
        await client_round(client, 4, 8, a.prompt_len, 0)  # warm-up, and the session is open
    for c in a.streams:
        acc: dict[str, list[dict[str, float]]] = {"ring": [], "socket": []}
        for r in range(a.rounds):
            for t in ("ring", "socket") if r % 2 == 0 else ("socket", "ring"):
                acc[t].append(await client_round(clients[t], c, a.tokens, a.prompt_len, 1000 * r))
        eng = base[c]
        for t, rs in acc.items():
            res = median_of(rs)
            emit(bench="transport_daemon", path=t, streams=c, **res,
                 overhead_ms_p50=res["itl_ms_p50"] - eng["itl_ms_p50"],
                 overhead_ms_mean=res["itl_ms_mean"] - eng["itl_ms_mean"],
                 overhead_pct_p50=100 * (res["itl_ms_p50"] / eng["itl_ms_p50"] - 1),
                 overhead_pct_mean=100 * (res["itl_ms_mean"] / eng["itl_ms_mean"] - 1))  # fmt: skip
    for client in clients.values():
        await client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("bundle", type=Path, nargs="?", help="a prepared bundle (else: the tiny model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 64])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path, help="work directory (tiny bundle, daemon socket, log)")
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    a = p.parse_args()
    if a.out:
        OUT.append(a.out)
    work = a.work or Path(tempfile.mkdtemp(prefix="flare-transport-"))
    work.mkdir(parents=True, exist_ok=True)
    bundle = a.bundle or tiny_bundle(work, a.device, max(a.streams))
    base = run_engine(bundle, a)
    daemon, sock = start_daemon(bundle, work, a.device)
    try:
        asyncio.run(run_daemon(sock, a, base))
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
    print(f"\n{'streams':>7} {'path':>6} {'itl p50':>8} {'itl mean':>8} {'itl p99':>8} "
          f"{'+p50 ms':>8} {'+mean ms':>8} {'+p50 %':>7} {'+mean %':>7}   (ms)")  # fmt: skip
    for r in RESULTS:
        print(f"{r['streams']:>7} {r['path']:>6} {r['itl_ms_p50']:>8.3f} {r['itl_ms_mean']:>8.3f} "
              f"{r['itl_ms_p99']:>8.3f} {r.get('overhead_ms_p50', 0):>8.3f} "
              f"{r.get('overhead_ms_mean', 0):>8.3f} {r.get('overhead_pct_p50', 0):>7.2f} "
              f"{r.get('overhead_pct_mean', 0):>7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
