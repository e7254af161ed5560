"""The blocking client's stream: events pumped by its loop thread (Client.stream) against the
previous way, one round trip through the loop per event, in the same run against one daemon.

    python benchmarks/client_stream.py --bundle B [--device cpu] [--repeat 40] [--out F.jsonl]

Starts `flare run B` (prefix cache on), then, alternating the two ways request by request:
  first_event  a full-prompt hit of a 64-token prompt (no forward pass: the daemon restores
               its checkpoint and samples), submit -> first event, in ms;
  stream       a 128-token stream: its wall time, and the consuming thread's CPU time per
               event (what the client spends per token while the engine paces the stream).
Prints one JSON line per way and measure (medians), then the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.agent_daemon import start_daemon, wait_ready


def round_trip_stream(c: Any, **kwargs: Any) -> Iterator[Any]:
    """The previous Client.stream: each event awaited from this thread through the loop."""
    agen = c._aclient.stream(**kwargs)
    try:
        while True:
            try:
                ev = c._run(agen.__anext__())
            except StopAsyncIteration:
                return
            yield ev
    finally:
        c._run(agen.aclose())


def measure(c: Any, way: str, prompt: list[int], seed: int) -> tuple[float, float, float]:
    """(first-event ms of a full hit, 128-token stream wall ms, consumer CPU µs per event)."""
    from libflare_client import SamplingParams

    def events(**kw: Any) -> Iterator[Any]:
        if way == "pumped":
            return iter(c.stream(**kw))
        return round_trip_stream(c, **kw)

    sp = SamplingParams(temperature=1.0, seed=seed)
    t0 = time.perf_counter()
    first = None
    for _ev in events(prompt_token_ids=prompt, max_tokens=1, sampling=sp, detokenize=False):
        first = first or time.perf_counter()
    assert first is not None
    t1, cpu0, n = time.perf_counter(), time.thread_time(), 0
    for ev in events(prompt_token_ids=prompt[:8], max_tokens=128, ignore_eos=True, sampling=sp,
                     detokenize=False):  # fmt: skip
        n += len(ev.token_ids)
    cpu = time.thread_time() - cpu0
    return 1e3 * (first - t0), 1e3 * (time.perf_counter() - t1), 1e6 * cpu / max(n, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from libflare_client import Client

    got: dict[str, list[tuple[float, float, float]]] = {"pumped": [], "round_trip": []}
    with tempfile.TemporaryDirectory(prefix="flare-client-") as tmp:
        work = Path(tmp)
        proc = start_daemon(args.bundle, work, args.device, cache=True)
        try:
            wait_ready(proc, work / "flared.sock", args.ready_timeout)
            with Client(work / "flared.sock") as c:
                prompt = list(range(5, 69))
                c.generate(prompt_token_ids=prompt, max_tokens=1)  # its checkpoint
                for r in range(args.repeat + 2):
                    order = ("pumped", "round_trip") if r % 2 else ("round_trip", "pumped")
                    for way in order:
                        m = measure(c, way, prompt, seed=r)
                        if r >= 2:  # two warm-up rounds
                            got[way].append(m)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    recs: list[dict[str, Any]] = []
    med = {
        way: [statistics.median(v[i] for v in vals) for i in range(3)] for way, vals in got.items()
    }
    for way, (first, wall, cpu) in med.items():
        recs.append({"kind": "client_stream", "way": way, "device": args.device,
                     "first_event_ms": first, "stream128_ms": wall, "consumer_cpu_us_per_event": cpu,
                     "repeats": len(got[way])})  # fmt: skip
    p, rt = med["pumped"], med["round_trip"]
    recs.append({"kind": "client_stream_ratio", "first_event": p[0] / rt[0],
                 "stream128": p[1] / rt[1], "consumer_cpu_per_event": p[2] / rt[2]})  # fmt: skip
    for rec in recs:
        print(json.dumps(rec))
    jsonl.append(args.out, recs)


if __name__ == "__main__":
    main()
