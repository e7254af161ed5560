"""Per-token delivery overhead daemon -> client through the real daemon: ring vs socket transport,
at 1/4/64 concurrent streams, against the engine's own inter-token latency in the same run.

    python benchmarks/transport_daemon.py                                   # tiny model, CPU
    python benchmarks/transport_daemon.py --bundle BUNDLE --device cuda \\
        --client-procs 8 --out benchmarks/results/transport_daemon_h200.jsonl

Method, for each concurrency c (the same c seeded fixed-length requests each time):
  engine   the bundle's Engine in a child process of its own (it exits, so the daemon later
           gets the whole device), a sink stamping every token as the engine thread emits it:
           the inter-token latency (ITL) with no daemon and no transport;
  ring     a `flared run BUNDLE` daemon; --client-procs client processes, each with one
           AsyncClient session (transport "ring", anticipate_events=False: doorbells only),
           stream the c requests concurrently and stamp every token as the stream yields it;
  ring-anticipate  the same with the client's anticipation (anticipate_events=True, the
           default on hosts of four or more CPUs: it polls the ring around each expected step
           instead of sleeping until the doorbell);
  socket   the same through the same daemon with transport "socket"; rounds alternate.
Both the engine child and the daemon read the same generated TOML, and the engine child sizes
its CPU thread team with the daemon's rule (flared/daemon_threads.py), so the only difference
between the rows is the daemon and the transport. Delivery overhead per token = client ITL -
engine ITL (p50 and mean, ms and % of the engine's): the daemon's loop, the detokenizer lanes,
encoding, the transport and the client SDK. Each row is the median over --rounds rounds.
A constant delivery delay cancels out of ITL; what shows is the daemon slowing the engine (GIL,
CPU) or not keeping up with it. Target: <= 2% at 64 streams on the H200.

daemon_cpu_us_per_token / client_cpu_us_per_token: process CPU per delivered token during the
rounds (the daemon's includes its engine thread, the same on both paths). `--label TEXT` tags
every line (e.g. the machine's condition).

Prints one JSON line per measurement (appended to --out), then a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
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
TRANSPORTS = ("ring", "ring-anticipate", "socket")  # ring-anticipate: anticipate_events=True


LABEL: list[str] = []


def emit(**rec: Any) -> None:
    rec.update(cpus=os.cpu_count(), loadavg_1m=round(os.getloadavg()[0], 2))
    if LABEL:
        rec["label"] = LABEL[0]
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


def median_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over the rounds; anything else (a list) from the last round."""
    return {
        k: statistics.median(r[k] for r in rounds) if isinstance(v, int | float) else rounds[-1][k]
        for k, v in rounds[0].items()
    }


# -- engine phase (a child process) -------------------------------------------------------------
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


def engine_phase(a: argparse.Namespace) -> int:
    """Runs in its own process; prints one JSON object per concurrency."""
    from flared.config import load_config
    from flared.daemon_threads import configure_engine_threads
    from flared.llm_engine import Engine

    threads = configure_engine_threads()  # the daemon's rule, before the engine thread starts
    eng = Engine(a.bundle, load_config(a.config).engine_config(a.bundle)).start()
    try:
        engine_round(eng, min(4, max(a.streams)), 8, a.prompt_len, 0)  # warm-up
        for c in a.streams:
            rs = [engine_round(eng, c, a.tokens, a.prompt_len, 1000 * r) for r in range(a.rounds)]
            print(json.dumps({"streams": c, "engine_cpu_threads": threads, **median_of(rs)}))
    finally:
        eng.shutdown()
    return 0


def run_engine(a: argparse.Namespace, config: Path) -> dict[int, dict[str, float]]:
    cmd = [sys.executable, __file__, "--phase", "engine", "--bundle", str(a.bundle), "--config",
           str(config), "--streams", ",".join(map(str, a.streams)), "--tokens", str(a.tokens),
           "--prompt-len", str(a.prompt_len), "--rounds", str(a.rounds)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["streams"]] = rec
            emit(bench="transport_daemon", path="engine", **rec)
    return out


# -- daemon phase: client worker processes ------------------------------------------------------
async def _client_round(
    client: Any, ids: range, tokens: int, plen: int, seed: int
) -> list[list[float]]:
    from libflare_client import SamplingParams

    all_prompts = prompts(ids.stop, plen)

    async def one(i: int) -> list[float]:
        out: list[float] = []
        async for ev in client.stream(all_prompts[i], max_tokens=tokens, min_tokens=tokens,
                                      ignore_eos=True,
                                      sampling=SamplingParams(temperature=1.0, seed=seed + i)):  # fmt: skip
            if ev.token_ids:
                out.extend([time.perf_counter()] * len(ev.token_ids))
        return out

    return list(await asyncio.gather(*(one(i) for i in ids)))


def client_worker(sock: str, conn: Any) -> None:
    """One client process: a ring and a socket session; runs the rounds the parent sends."""
    from libflare_client import AsyncClient

    async def main() -> None:
        clients = {
            t: AsyncClient(sock, transport=t.split("-")[0], liveness_timeout_s=60,
                           anticipate_events=t == "ring-anticipate")
            for t in TRANSPORTS
        }  # fmt: skip
        await clients["ring"].wait_ready(timeout_s=900)
        for client in clients.values():
            await client.connect()
        conn.send("ready")
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, conn.recv)) is not None:
            transport, lo, hi, tokens, plen, seed = cmd
            cpu0 = time.process_time()
            stats0 = clients[transport].transport_stats()
            times = await _client_round(clients[transport], range(lo, hi), tokens, plen, seed)
            stats = clients[transport].transport_stats()
            conn.send((times, time.process_time() - cpu0, {k: stats[k] - stats0[k] for k in stats}))
        for client in clients.values():
            await client.close()

    asyncio.run(main())


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (name, user + system CPU seconds) of every thread of a process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name, rest = task.joinpath("stat").read_text().split("(", 1)[1].rsplit(")", 1)
        except (OSError, ValueError):
            continue  # the thread ended
        f = rest.split()
        out[int(task.name)] = (name, (int(f[11]) + int(f[12])) / tick)
    return out


def busy_threads(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]],
                 wall_s: float) -> dict[str, object]:  # fmt: skip
    """Which of the daemon's threads spent the round's CPU: how many were busy more than a
    tenth of the round, and the four busiest (name, share of the round's wall time)."""
    used = sorted(
        ((cpu - before.get(tid, (name, 0.0))[1], name) for tid, (name, cpu) in after.items()),
        reverse=True,
    )
    return {
        "daemon_threads_busy": float(sum(1 for cpu, _ in used if cpu > 0.1 * wall_s)),
        "daemon_busiest_threads": [(name, round(cpu / wall_s, 3)) for cpu, name in used[:4]],
    }


class Workers:
    def __init__(self, sock: Path, n: int, daemon_pid: int) -> None:
        self.daemon_pid = daemon_pid
        ctx = mp.get_context("spawn")
        self.pipes = []
        self.procs = []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_worker, args=(str(sock), child), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for p in self.pipes:
            assert p.recv() == "ready"

    def round(self, transport: str, c: int, tokens: int, plen: int, seed: int) -> dict[str, float]:
        """The c streams split over the workers (stream i is the same request on every path)."""
        n = min(len(self.pipes), c)
        bounds = [c * k // n for k in range(n + 1)]
        daemon_cpu0 = process_cpu_s(self.daemon_pid)
        threads0, t0 = thread_cpu_s(self.daemon_pid), time.perf_counter()
        for k in range(n):
            self.pipes[k].send((transport, bounds[k], bounds[k + 1], tokens, plen, seed))
        replies = [self.pipes[k].recv() for k in range(n)]
        daemon_cpu = process_cpu_s(self.daemon_pid) - daemon_cpu0
        threads = busy_threads(threads0, thread_cpu_s(self.daemon_pid), time.perf_counter() - t0)
        per_stream = [times for got, _, _ in replies for times in got]
        out = itl_stats(per_stream)
        total = sum(len(t) for t in per_stream)
        # CPU per delivered token: the daemon's includes its engine thread's (same on both paths)
        out["daemon_cpu_us_per_token"] = 1e6 * daemon_cpu / max(1, total)
        out["client_cpu_us_per_token"] = 1e6 * sum(cpu for _, cpu, _ in replies) / max(1, total)
        for key in ("doorbell_wakes", "poll_windows", "polls_caught", "late_publishes"):
            out[key] = float(sum(stats[key] for _, _, stats in replies))
        out.update(threads)
        return out

    def close(self) -> None:
        for p in self.pipes:
            p.send(None)
        for proc in self.procs:
            proc.join(timeout=30)


def start_daemon(bundle: Path, work: Path, config: Path) -> tuple[subprocess.Popen[bytes], Path]:
    sock = work / "sock" / "flared.sock"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = (work / "flared.log").open("wb")
    cmd = [sys.executable, "-m", "flared.cli", "run", str(bundle), "--socket", str(sock),
           "--config", str(config)]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=log), sock


def run_daemon(
    sock: Path, pid: int, a: argparse.Namespace, base: dict[int, dict[str, float]]
) -> None:
    workers = Workers(sock, a.client_procs, pid)
    try:
        for t in TRANSPORTS:  # warm-up
            workers.round(t, min(4, max(a.streams)), 8, a.prompt_len, 0)
        for c in a.streams:
            acc: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
            for r in range(a.rounds):
                for t in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                    acc[t].append(workers.round(t, c, a.tokens, a.prompt_len, 1000 * r))
            eng = base[c]
            for t, rs in acc.items():
                res = median_of(rs)
                emit(bench="transport_daemon", path=t, streams=c, client_procs=min(a.client_procs, c),
                     engine_cpu_threads=eng["engine_cpu_threads"], **res,
                     overhead_ms_p50=res["itl_ms_p50"] - eng["itl_ms_p50"],
                     overhead_ms_mean=res["itl_ms_mean"] - eng["itl_ms_mean"],
                     overhead_pct_p50=100 * (res["itl_ms_p50"] / eng["itl_ms_p50"] - 1),
                     overhead_pct_mean=100 * (res["itl_ms_mean"] / eng["itl_ms_mean"] - 1))  # fmt: skip
    finally:
        workers.close()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("bundle_pos", type=Path, nargs="?", metavar="BUNDLE", help="same as --bundle")
    p.add_argument("--bundle", type=Path, help="a prepared bundle (else: the tiny model)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 64])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--client-procs",
        type=int,
        default=1,
        help="client processes sharing the streams (one session per transport each)",
    )
    p.add_argument("--work", type=Path, help="work directory (tiny bundle, daemon socket, log)")
    p.add_argument("--out", type=Path, help="append the JSON lines to this file")
    p.add_argument("--label", help="a tag added to every JSON line")
    p.add_argument("--step-wait", choices=["spin", "block"], default="spin",
                   help="[engine] step_wait of the engine child and the daemon")  # fmt: skip
    p.add_argument("--phase", choices=["all", "engine"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.bundle = a.bundle or a.bundle_pos
    return a


def main() -> int:
    a = parse_args()
    if a.phase == "engine":
        return engine_phase(a)
    if a.out:
        OUT.append(a.out)
    if a.label:
        LABEL.append(a.label)
    work = a.work or Path(tempfile.mkdtemp(prefix="flare-transport-"))
    work.mkdir(parents=True, exist_ok=True)
    a.bundle = a.bundle or tiny_bundle(work, a.device, max(a.streams))
    config = work / "flared.toml"  # read by the engine child and the daemon alike
    config.write_text(f'[engine]\ndevice = "{a.device}"\nstep_wait = "{a.step_wait}"\n')
    base = run_engine(a, config)
    daemon, sock = start_daemon(a.bundle, work, config)
    try:
        run_daemon(sock, daemon.pid, a, base)
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)
    print(f"\n{'streams':>7} {'path':>6} {'itl p50':>8} {'itl mean':>8} {'itl p99':>8} "
          f"{'+p50 ms':>8} {'+mean ms':>8} {'+p50 %':>7} {'+mean %':>7} "
          f"{'daemon us/tok':>13} {'client us/tok':>13}   (ms unless noted)")  # fmt: skip
    for r in RESULTS:
        print(f"{r['streams']:>7} {r['path']:>6} {r['itl_ms_p50']:>8.3f} {r['itl_ms_mean']:>8.3f} "
              f"{r['itl_ms_p99']:>8.3f} {r.get('overhead_ms_p50', 0):>8.3f} "
              f"{r.get('overhead_ms_mean', 0):>8.3f} {r.get('overhead_pct_p50', 0):>7.2f} "
              f"{r.get('overhead_pct_mean', 0):>7.2f} "
              f"{r.get('daemon_cpu_us_per_token', 0):>13.1f} "
              f"{r.get('client_cpu_us_per_token', 0):>13.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
