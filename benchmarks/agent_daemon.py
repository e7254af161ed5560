"""The agent trace as an agent runs it: a client process talking to `flared` over its socket.

    python benchmarks/agent_daemon.py --bundle BUNDLE [--device cuda] [--repeat 3]
                                      [--mode both|cache|recompute] [--out F.jsonl]

`agent_trace.py` drives the engine in-process, so its client's Python shares the engine
thread's GIL. Here the same `agent_trace.Trace` (system prompt, 10 turns appending 300-token tool
results, two branches from turn 5) runs through `libflare_client.Client` against a `flare run`
child, with the message ends declared on the wire (`message_ends`), once against a daemon with
the prefix cache and once against one without (the recomputed turns). TTFT is the client's:
submit to the first token event, transport included. Prints one JSON line per request (median
over `--repeat` conversations, each with its own tokens) and the turn-10 ratio. The cache
daemon also serves agent_trace's prefix rows (4,096-token prefix + 11-token tail, the full
prefix again, a cold 11-token prompt), whose full-prompt hit, compared with agent_trace's
in-process one, is the daemon's and the transport's own cost on the first token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.agent_trace import Trace, _tokens

CONFIG = """
[engine]
device = "{device}"
prefix_cache = {cache}
"""


def start_daemon(bundle: Path, workdir: Path, device: str, cache: bool) -> subprocess.Popen:
    config = workdir / "flared.toml"
    config.write_text(CONFIG.format(device=device, cache="true" if cache else "false"))
    cmd = [sys.executable, "-m", "flared.cli", "run", str(bundle), "--socket",
           str(workdir / "flared.sock"), "--config", str(config)]  # fmt: skip
    log = (workdir / "flared.log").open("wb")
    return subprocess.Popen(cmd, stdout=log, stderr=log)


def wait_ready(proc: subprocess.Popen, socket: Path, timeout_s: float) -> None:
    from libflare_client import Client, ConnectionLost

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"flared exited with {proc.returncode} (see {socket.parent})")
        with contextlib.suppress(ConnectionLost), Client(socket) as c:  # not listening yet
            if c.health() == "ready":
                return
        time.sleep(0.2)
    raise SystemExit(f"flared not ready within {timeout_s}s")


def run(
    socket: Path, repeat: int, vocab: int, prefix_rows: bool
) -> dict[str, list[tuple[float, int]]]:
    """Request label -> [(client TTFT ms, cached tokens)] over `repeat` conversations."""
    from libflare_client import Client, SamplingParams

    out: dict[str, list[tuple[float, int]]] = {}
    with Client(socket) as c:
        for salt in range(1, repeat + 1):

            def serve(name: str, prompt: list[int], ends: tuple[int, ...], salt=salt) -> list[int]:
                t0 = time.perf_counter()
                first = None
                tokens: list[int] = []
                cached = 0
                for ev in c.stream(prompt_token_ids=prompt, max_tokens=Trace.CALL,
                                   ignore_eos=True, message_ends=list(ends), detokenize=False,
                                   sampling=SamplingParams(temperature=1.0, seed=salt)):  # fmt: skip
                    if ev.token_ids and first is None:
                        first = time.perf_counter()
                    tokens += ev.token_ids
                    if ev.usage is not None:
                        cached = ev.usage.cached_tokens
                assert first is not None
                out.setdefault(name, []).append((1e3 * (first - t0), cached))
                return tokens

            Trace(2048, 300, vocab, salt).run(serve)
            if not prefix_rows:
                continue
            # agent_trace's prefix rows, through the daemon: a 4,096-token prefix + 11-token
            # tail, the full prefix again (a full-prompt hit: no forward pass), a cold 11
            r = salt - 1
            prefix = _tokens(4096, 900 + r, vocab)
            serve("prefix_warm", prefix, ())  # checkpoint at the prompt boundary
            serve("prefix_hit", prefix + _tokens(11, 950 + r, vocab), (4096,))
            serve("full_hit", prefix, ())
            serve("cold_11", _tokens(11, 990 + r, vocab), ())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--mode", choices=["both", "cache", "recompute"], default="both")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from prep.bundle import read_manifest

    vocab = read_manifest(args.bundle).geometry.vocab_size
    records: list[dict] = []
    medians: dict[str, dict[str, float]] = {}
    for cache in (True, False):
        mode = "cache" if cache else "recompute"
        if args.mode not in ("both", mode):
            continue
        with tempfile.TemporaryDirectory(prefix="flare-agent-") as tmp:
            work = Path(tmp)
            proc = start_daemon(args.bundle, work, args.device, cache)
            try:
                wait_ready(proc, work / "flared.sock", args.ready_timeout)
                got = run(work / "flared.sock", args.repeat, vocab, prefix_rows=cache)
            except BaseException:
                log = (work / "flared.log").read_text(errors="replace").splitlines()
                print("\n".join(log[-40:]), file=sys.stderr)
                raise
            finally:
                proc.terminate()
                proc.wait(timeout=60)
        for name, vals in got.items():
            ms = statistics.median(v[0] for v in vals)
            medians.setdefault(mode, {})[name] = ms
            records.append({"kind": "agent_turn_daemon", "mode": mode, "request": name,
                            "ttft_ms": ms, "cached_tokens": min(v[1] for v in vals),
                            "repeats": len(vals)})  # fmt: skip
    if "turn10" in medians.get("cache", {}) and "turn10" in medians.get("recompute", {}):
        records.append({"kind": "agent_turn10_ratio",
                        "ratio": medians["recompute"]["turn10"] / medians["cache"]["turn10"]})  # fmt: skip
    for rec in records:
        print(json.dumps(rec))
    jsonl.append(args.out, records)


if __name__ == "__main__":
    main()
