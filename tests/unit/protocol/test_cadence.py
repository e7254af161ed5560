"""The event reader's anticipation: Cadence's predictions from publish times, and WakeTimer."""

from __future__ import annotations

import select
import time

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


def test_wake_timer_fires_not_before_its_time_and_disarms() -> None:
    timer = WakeTimer.create()
    if timer is None:
        pytest.skip("no timerfd on this platform")
    ep = select.epoll()
    try:
        ep.register(timer.fd, select.EPOLLIN)
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
    finally:
        ep.close()
        timer.close()
    assert timer.fd == -1


def test_a_readiness_from_before_a_rearm_is_not_an_expiry() -> None:
    """A poller can report the timer ready in the same batch as a doorbell whose handler then
    re-arms it for the next window; `clear` must say that expiry is gone (the reader would
    otherwise poll, its sleep withdrawn, until the next window's end)."""
    timer = WakeTimer.create()
    if timer is None:
        pytest.skip("no timerfd on this platform")
    ep = select.epoll()
    try:
        ep.register(timer.fd, select.EPOLLIN)
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
    finally:
        ep.close()
        timer.close()


def test_late_steps_are_counted_and_pauses_are_not() -> None:
    times = [i * PERIOD for i in range(10)]
    c = _fed(times)  # learned every 8 batches: the period is known by now
    assert c.late == 0
    c.observe(times[-1] + 2 * PERIOD)  # one step late (the producer was delayed)
    assert c.late == 1
    c.observe(times[-1] + 3 * PERIOD)
    c.observe(times[-1] + 3 * PERIOD + 10 * PERIOD)  # a pause: learning starts over
    assert c.late == 1 and c.period is None
