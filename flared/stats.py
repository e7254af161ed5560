"""Small, lock-free-enough metric helpers shared by the engine and the daemon."""

from __future__ import annotations

from collections import deque


class Histogram:
    """Keeps the last `window` samples and a running count/sum; summaries are medians and p99."""

    def __init__(self, window: int = 4096) -> None:
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self._recent.append(value)
        self.count += 1
        self.total += value

    def summary(self) -> dict[str, float]:
        data = sorted(self._recent)
        if not data:
            return {"count": 0}
        return {
            "count": self.count,
            "mean": self.total / self.count,
            "p50": data[len(data) // 2],
            "p99": data[min(len(data) - 1, int(len(data) * 0.99))],
            "max": data[-1],
        }
