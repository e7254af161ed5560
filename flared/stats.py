"""Small, lock-free-enough metric helpers shared by the engine and the daemon."""

from __future__ import annotations

from collections import deque

# Cumulative bucket bounds (ms) of latency histograms, Prometheus-style (`le_<bound>` counts).
LATENCY_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class Histogram:
    """Keeps the last `window` samples and a running count/sum; summaries are medians and p99.
    With `buckets`, also cumulative counts per upper bound over every sample ever added."""

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
