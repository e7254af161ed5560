"""Small, lock-free-enough metric helpers shared by the engine and the daemon."""

from __future__ import annotations

from bisect import bisect_left

import numpy as np

# Cumulative bucket bounds (ms) of latency histograms, Prometheus-style (`le_<bound>` counts).
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Histogram:
    """Keeps the last `window` samples and a running count/sum; summaries are medians and p99.
    With `buckets`, also cumulative counts per upper bound over every sample ever added.

    The engine thread adds a sample per step (and per token event); any thread may ask for a
    summary. Samples go into a preallocated float64 ring, and a summary selects its three order
    statistics with one `np.partition` of that ring: it holds the GIL for about 0.03 ms where
    sorting a 4,096-sample window as Python floats held it for 0.3 ms per histogram, the engine
    thread waiting all that time (a stats request summarises six of them;
    benchmarks/stats_cost.py)."""

    def __init__(self, window: int = 4096, buckets: tuple[float, ...] = ()) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._ring = np.zeros(window, dtype=np.float64)
        self._next = 0  # the ring slot the next sample goes to
        self.count = 0
        self.total = 0.0
        self.buckets = tuple(sorted(buckets))
        self._in_bucket = [0] * (len(self.buckets) + 1)  # per bucket, the last one: above all

    def add(self, value: float) -> None:
        i = self._next
        self._ring[i] = value
        self._next = 0 if i + 1 == len(self._ring) else i + 1
        self.count += 1
        self.total += value
        if self.buckets:
            # the first bound >= value: `le_<bound>` is cumulative, summed in summary()
            self._in_bucket[bisect_left(self.buckets, value)] += 1

    def summary(self) -> dict[str, float]:
        n = min(self.count, len(self._ring))
        if not n:
            return {"count": 0}
        ranks = [n // 2, min(n - 1, int(n * 0.99)), n - 1]  # nearest-rank order statistics
        # np.partition works on a copy, taken in one C call: an add() from another thread
        # lands before or after it, never inside
        picked = np.partition(self._ring[:n], ranks)[ranks].tolist()
        out = {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": picked[0],
            "p99": picked[1],
            "max": picked[2],
        }
        below = 0
        for bound, k in zip(self.buckets, self._in_bucket, strict=False):
            below += k
            out[f"le_{bound:g}"] = below
        return out
