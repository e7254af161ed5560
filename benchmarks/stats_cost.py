"""What a stats request costs the engine: the metric histograms' summaries, and the decode steps
they stall while another thread of the process asks for them (the daemon answers `stats` and
`flare status` on its event-loop thread, beside the engine thread, under one GIL).

    python benchmarks/stats_cost.py [--bundle B] [--device cpu] [--tokens 400] [--poll-ms 5]

Two implementations in the same run: `sorted` (the window sorted as Python floats per summary:
the previous `flared.stats.Histogram`, kept here as the baseline) and `partition` (the current
one: a float64 ring and one `np.partition`).
  summary   ms to summarise the engine's six histograms, each holding a full 4,096-sample
            window, and µs per `add` (the engine thread adds per step and per token event);
  stall     one request decoding --tokens tokens on the bundle's engine, its histograms
            pre-filled to a full window (a daemon that has served a while), while a thread
            calls `Engine.stats()` every --poll-ms: inter-token latency p50 / p99 / max, also
            with nobody polling (`none`). Without --bundle: a tiny random-weight Qwen3.
Prints one JSON line per measurement (appended to --out), then a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from flared.stats import LATENCY_BUCKETS_MS, Histogram

HISTOGRAMS = ("step_ms", "host_ms", "submission_gap_ms", "device_ms", "ttft_ms", "itl_ms")


class SortedWindowHistogram:
    """The baseline: the previous implementation (a deque window sorted per summary)."""

    def __init__(self, window: int = 4096, buckets: tuple[float, ...] = ()) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total = 0.0
        self.buckets = buckets
        self._bucket_counts = [0] * len(buckets)

    def add(self, value: float) -> None:
        self._recent.append(value)
        self.count += 1
        self.total += value
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self._bucket_counts[i] += 1

    def summary(self) -> dict[str, float]:
        data = sorted(self._recent)
        if not data:
            return {"count": 0}
        out = {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": data[len(data) // 2],
            "p99": data[min(len(data) - 1, int(len(data) * 0.99))],
            "max": data[-1],
        }
        for bound, n in zip(self.buckets, self._bucket_counts, strict=True):
            out[f"le_{bound:g}"] = n
        return out


IMPLS = {"sorted": SortedWindowHistogram, "partition": Histogram}


def _full(cls: type, name: str, rng: random.Random):
    """The engine's histogram `name` as `cls`, its window full (a daemon that has served a
    while): the latency ones bucketed, as in Engine."""
    h = cls(buckets=LATENCY_BUCKETS_MS if name in ("ttft_ms", "itl_ms") else ())
    for _ in range(4096):
        h.add(rng.random() * 20)
    return h


def summary_cost(impl: str, repeats: int) -> dict:
    rng = random.Random(0)
    hists = [_full(IMPLS[impl], name, rng) for name in HISTOGRAMS]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for h in hists:
            h.summary()
        times.append(1e3 * (time.perf_counter() - t))
    h = hists[-1]
    t = time.perf_counter()
    for _ in range(20_000):
        h.add(1.5)
    add_us = 1e6 * (time.perf_counter() - t) / 20_000
    return {"bench": "stats_cost", "measure": "summary", "impl": impl,
            "summary_ms_p50": statistics.median(times), "add_us": add_us}  # fmt: skip


def stall(eng, impl: str | None, tokens: int, poll_ms: float, seed: int) -> dict:
    """ITL of one decoding request while a thread polls eng.stats() (impl None: no poller)."""
    from flared.engine.events import TokenEvent
    from flared.requests import SamplingParams

    rng = random.Random(1)
    for name in HISTOGRAMS:
        setattr(eng, name, _full(IMPLS[impl or "partition"], name, rng))
    stop = threading.Event()
    polls = [0]

    def poll() -> None:
        while not stop.wait(poll_ms / 1e3):
            eng.stats()
            polls[0] += 1

    poller = threading.Thread(target=poll, daemon=True) if impl else None
    if poller:
        poller.start()
    stamps = []
    prompt = [rng.randrange(10, 200) for _ in range(32)]
    sampling = SamplingParams(temperature=1.0, seed=seed)
    for ev in eng.stream(prompt, max_tokens=tokens, ignore_eos=True, sampling=sampling):
        if isinstance(ev, TokenEvent):
            stamps.append(time.perf_counter())
    stop.set()
    if poller:
        poller.join()
    gaps = sorted(1e3 * (b - a) for a, b in itertools.pairwise(stamps))
    return {"bench": "stats_cost", "measure": "stall", "impl": impl or "none",
            "poll_ms": poll_ms, "polls": polls[0], "tokens": len(stamps),
            "itl_ms_p50": gaps[len(gaps) // 2], "itl_ms_p99": gaps[int(len(gaps) * 0.99)],
            "itl_ms_max": gaps[-1]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--poll-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from flared.llm_engine import Engine, EngineConfig

    records = [summary_cost(impl, 50) for impl in IMPLS]
    with tempfile.TemporaryDirectory() as tmp:
        bundle = args.bundle
        if bundle is None:
            from benchmarks.transport_daemon import tiny_bundle

            bundle = tiny_bundle(Path(tmp), args.device, 4)
        eng = Engine(bundle, EngineConfig(device=args.device)).start()
        try:
            stall(eng, None, 32, args.poll_ms, 0)  # warm-up
            rows: dict[str, list[dict]] = {}
            for r in range(args.rounds):  # alternate: the machine drifts
                for impl in (None, "sorted", "partition"):
                    rec = stall(eng, impl, args.tokens, args.poll_ms, r)
                    rows.setdefault(rec["impl"], []).append(rec)
        finally:
            eng.shutdown()
    for recs in rows.values():
        med = {
            k: statistics.median(x[k] for x in recs)
            for k in ("itl_ms_p50", "itl_ms_p99", "itl_ms_max")
        }
        records.append({**recs[0], **med, "polls": sum(x["polls"] for x in recs),
                        "rounds": len(recs), "stat": "median over rounds"})  # fmt: skip
    for rec in records:
        print(json.dumps(rec))
    jsonl.append(args.out, records)
    print("\n| measure | impl | summary ms (6) | add µs | ITL p50 | ITL p99 | ITL max |")
    for rec in records:
        cells = [f"{rec[k]:.3f}" if k in rec else "-" for k in
                 ("summary_ms_p50", "add_us", "itl_ms_p50", "itl_ms_p99", "itl_ms_max")]  # fmt: skip
        print(f"| {rec['measure']} | {rec['impl']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
