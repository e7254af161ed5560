"""The event reader's anticipation: Cadence's predictions from publish times, and WakeTimer."""

from __future__ import annotations

import contextlib
import select
import time
from collections.abc import Iterator

import pytest

from shm_protocol.cadence import Cadence, WakeTimer

PERIOD = 2e-3
LEAD = 100e-6


def _fed(times: list[float], **kw: float) -> Cadence:
    c = Cadence(lead_s=LEAD, **kw)  # type: ignore[arg-type]
    for t in times:
        c.observe(t)
    return c


def test_no_window_until_enough_regular_intervals() -> None:
    c = Cadence(lead_s=LEAD, min_intervals=4)
    for i in range(5):
        assert c.window(i * PERIOD) is None  # 0..3 intervals so far
        c.observe(i * PERIOD)
    assert c.period == pytest.approx(PERIOD)
    window = c.window(4 * PERIOD + 1e-4)
    assert window == pytest.approx((5 * PERIOD - LEAD, 5 * PERIOD + LEAD))


def test_one_late_and_one_early_step_move_neither_period_nor_prediction() -> None:
    times = [i * PERIOD for i in range(9)]
    times[4] += 300e-6  # a slow step
    times[6] -= 200e-6  # and an early one
    c = _fed(times)
    assert c.period == pytest.approx(PERIOD, abs=1e-9)
    assert c.expected() == pytest.approx(9 * PERIOD, abs=1e-9)


def test_a_pause_starts_the_learning_over() -> None:
    c = _fed([i * PERIOD for i in range(8)])
    assert c.period is not None
    c.observe(7 * PERIOD + 10 * PERIOD)  # the stream paused (or a long prompt was admitted)
    assert c.period is None and c.window(18 * PERIOD) is None


def test_the_same_publish_seen_twice_counts_once() -> None:
    c = _fed([0.0, PERIOD, PERIOD, 2 * PERIOD, 3 * PERIOD, 3 * PERIOD, 4 * PERIOD])
    assert c.period == pytest.approx(PERIOD)


def test_a_fast_stream_gets_no_window() -> None:
    """Polling 2 * lead per period would exceed max_duty: a flood keeps its reader busy anyway."""
    fast = 500e-6
    c = _fed([i * fast for i in range(10)], max_duty=0.25)
    assert c.period == pytest.approx(fast)
    assert c.window(9 * fast) is None


def test_an_overdue_batch_gets_no_window_and_a_late_start_is_clamped() -> None:
    c = _fed([i * PERIOD for i in range(6)])
    assert c.window(6 * PERIOD + 2 * LEAD) is None  # the doorbell will announce it
    start, end = c.window(6 * PERIOD)  # type: ignore[misc]
    assert start == pytest.approx(6 * PERIOD) and end == pytest.approx(6 * PERIOD + LEAD)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Cadence(lead_s=0)
    with pytest.raises(ValueError):
        Cadence(max_duty=1.5)


@contextlib.contextmanager
def _timer_in_epoll() -> Iterator[tuple[WakeTimer, select.epoll]]:
    """A WakeTimer registered in an epoll (as the client's loop polls it), both closed after."""
    timer = WakeTimer.create()
    if timer is None:
        pytest.skip("no timerfd on this platform")
    ep = select.epoll()
    try:
        ep.register(timer.fd, select.EPOLLIN)
        yield timer, ep
    finally:
        ep.close()
        timer.close()


def test_wake_timer_fires_not_before_its_time_and_disarms() -> None:
    with _timer_in_epoll() as (timer, ep):
        for delay in (0.0005, 0.002):
            at = time.monotonic() + delay
            timer.arm_at(at)
            assert ep.poll(5.0), "the timer did not fire within 5 s"
            assert time.monotonic() >= at
            assert timer.clear()
            assert not timer.armed
            assert ep.poll(0) == []  # consumed
        timer.arm_at(time.monotonic() + 0.05)
        timer.disarm()
        assert ep.poll(0.1) == []  # disarmed: never fires
        timer.arm_at(time.monotonic() - 1.0)  # in the past: fires at once
        assert ep.poll(1.0)
        timer.clear()
    assert timer.fd == -1


def test_a_readiness_from_before_a_rearm_is_not_an_expiry() -> None:
    """A poller can report the timer ready in the same batch as a doorbell whose handler then
    re-arms it for the next window; `clear` must say that expiry is gone (the reader would
    otherwise poll, its sleep withdrawn, until the next window's end)."""
    with _timer_in_epoll() as (timer, ep):
        timer.arm_at(time.monotonic() - 1.0)
        assert ep.poll(1.0)  # reported ready...
        at = time.monotonic() + 0.05
        timer.arm_at(at)  # ...then re-armed before the handler ran
        assert timer.clear() is False
        assert timer.armed  # still armed for the new instant
        assert ep.poll(5.0)
        assert time.monotonic() >= at
        assert timer.clear() is True
        assert not timer.armed


def test_late_steps_are_counted_and_pauses_are_not() -> None:
    times = [i * PERIOD for i in range(10)]
    c = _fed(times)  # learned every 8 batches: the period is known by now
    assert c.late == 0
    c.observe(times[-1] + 2 * PERIOD)  # one step late (the producer was delayed)
    assert c.late == 1
    c.observe(times[-1] + 3 * PERIOD)
    c.observe(times[-1] + 3 * PERIOD + 10 * PERIOD)  # a pause: learning starts over
    assert c.late == 1 and c.period is None


def _steps_in_parts(steps: int, offsets: tuple[float, ...], period: float = PERIOD) -> Cadence:
    """A stream whose every step is published in parts at `offsets` after its first publish
    (the daemon flushes each detokenizer lane's events when that lane is done)."""
    c = Cadence(lead_s=LEAD)
    for i in range(steps):
        for off in offsets:
            c.observe(i * period + off)
            c.window(i * period + off)  # the reader asks after every batch: learns eagerly
    return c


@pytest.mark.parametrize("offsets", [(0.0, 40e-6), (0.0, 20e-6, 45e-6), (0.0, 150e-6)])
def test_a_step_published_in_parts_is_one_step(offsets: tuple[float, ...]) -> None:
    c = _steps_in_parts(12, offsets)
    assert c.period == pytest.approx(PERIOD)
    assert c.expected() == pytest.approx(12 * PERIOD)  # the next step's first part
    assert c.late == 0


def test_parts_further_apart_than_burst_s_are_grouped_once_the_period_is_known() -> None:
    """300 µs between a step's parts (a slow host) is over burst_s: until the period is known
    they count as steps of their own, then burst_frac of the period groups them."""
    c = _steps_in_parts(20, (0.0, 300e-6))
    assert c.burst_s < 300e-6
    assert c.period == pytest.approx(PERIOD)
    assert c.expected() == pytest.approx(20 * PERIOD)
    window = c.window(19 * PERIOD + 400e-6)
    assert window == pytest.approx((20 * PERIOD - LEAD, 20 * PERIOD + LEAD))


def test_the_reader_lingers_for_the_rest_of_a_step_in_parts_and_no_longer() -> None:
    spread = 40e-6
    c = _steps_in_parts(12, (0.0, spread))
    t0 = 12 * PERIOD
    c.observe(t0)  # the next step's first part, taken 5 µs after it landed
    assert c.linger(now=t0 + 5e-6) == pytest.approx(1.25 * spread - 5e-6)
    c.observe(t0 + spread)  # its last part: nothing more is coming for a period
    assert c.linger(now=t0 + spread + 5e-6) == 0.0
    one_part = _steps_in_parts(12, (0.0,))
    one_part.observe(12 * PERIOD)
    assert one_part.linger(now=12 * PERIOD + 5e-6) == 0.0


def test_a_flood_lingers_four_gaps_and_a_step_in_parts_does_not_count_as_one() -> None:
    gap = 4e-6
    flood = Cadence(lead_s=LEAD)
    for i in range(5000):  # 20 ms: its "steps" (burst_s groups) have a period learned
        flood.observe(i * gap)
        flood.window(i * gap)
    assert flood.period is not None and flood.period <= 2 * flood.burst_s
    assert flood.linger(now=5000 * gap) == pytest.approx(4 * gap)
    parts = _steps_in_parts(12, (0.0, 10e-6, 20e-6))  # close parts, but steps a period apart
    assert parts.linger(now=11 * PERIOD + 21e-6) == 0.0


def test_anticipation_is_on_by_default_only_where_the_client_has_cpus_to_spare(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from libflare_client import _connection
    from shm_protocol import cadence

    monkeypatch.delenv("FLARE_CLIENT_ANTICIPATE", raising=False)
    monkeypatch.setattr(cadence, "cgroup_cpu_limit", lambda: None)  # no quota
    for cpus, want in ((1, False), (2, False), (3, False), (4, True), (16, True)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert _connection.anticipation_default() is want, cpus
        assert _connection.anticipation_default(True) is True  # an explicit choice wins
        assert _connection.anticipation_default(False) is False
    for quota, want in ((2.0, False), (3.5, True), (64.0, True)):  # 16 cores visible
        monkeypatch.setattr(cadence, "cgroup_cpu_limit", lambda q=quota: q)
        assert _connection.anticipation_default() is want, quota  # a 2-CPU container: off
    monkeypatch.setenv("FLARE_CLIENT_ANTICIPATE", "1")  # the operator's override
    assert _connection.anticipation_default() is True
    assert _connection.anticipation_default(False) is False
    monkeypatch.setenv("FLARE_CLIENT_ANTICIPATE", "0")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert _connection.anticipation_default() is False
