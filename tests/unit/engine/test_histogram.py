"""The metric histogram's summary is the exact nearest-rank statistics of its window."""

from __future__ import annotations

import random

import pytest

from flared.stats import LATENCY_BUCKETS_MS, Histogram


def _expected(samples: list[float], window: int, buckets: tuple[float, ...]) -> dict[str, float]:
    """The summary as the previous implementation computed it: sort the window."""
    data = sorted(samples[-window:])
    out = {
        "count": len(samples),
        "mean": sum(samples) / len(samples),
        "p50": data[len(data) // 2],
        "p99": data[min(len(data) - 1, int(len(data) * 0.99))],
        "max": data[-1],
    }
    for bound in buckets:
        out[f"le_{bound:g}"] = sum(1 for v in samples if v <= bound)
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 99, 100, 101, 4095, 4096, 4097, 10_000])
def test_summary_matches_the_sorted_window(n: int) -> None:
    rng = random.Random(n)
    # ties and bucket-bound values included: a bound's own value counts in its bucket
    samples = [rng.choice([rng.random() * 30, 1.0, 2.0, 5.0, 10.0]) for _ in range(n)]
    h = Histogram(buckets=LATENCY_BUCKETS_MS)
    for v in samples:
        h.add(v)
    got = h.summary()
    want = _expected(samples, 4096, LATENCY_BUCKETS_MS)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_window_wraps_and_keeps_only_the_last_samples() -> None:
    h = Histogram(window=4)
    for v in [100.0, 100.0, 100.0, 100.0, 1.0, 2.0, 3.0]:
        h.add(v)
    s = h.summary()
    # window: 2, 3, 100 and 1 -> sorted 1, 2, 3, 100
    assert (s["count"], s["p50"], s["p99"], s["max"]) == (7, 3.0, 100.0, 100.0)
    assert s["mean"] == pytest.approx(406.0 / 7)
    for v in [4.0, 5.0, 6.0, 7.0]:
        h.add(v)
    assert h.summary()["max"] == 7.0  # every 100 has left the window


def test_empty_and_unbucketed() -> None:
    h = Histogram()
    assert h.summary() == {"count": 0}
    h.add(0.5)
    assert h.summary() == {"count": 1, "mean": 0.5, "p50": 0.5, "p99": 0.5, "max": 0.5}
    with pytest.raises(ValueError, match="window"):
        Histogram(window=0)
