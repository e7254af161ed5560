"""Waking up just before the next batch of events: a ring reader that is awake when records land
needs no doorbell and no scheduler wake-up.

A decoding engine publishes a step's events at a steady cadence (the inter-token latency). A
reader that sleeps until its doorbell pays, per step, the producer's doorbell syscall and its own
wake-up (a context switch onto a cold CPU): on the development machine that made a paced ring
event slower than the same event sent as a socket frame. `Cadence` learns the interval between
batches and names a short window around the next expected arrival; the reader sleeps, with its
sleep declared (so an early batch still rings), until the window opens, withdraws the
declaration (`RingReader.wake`), polls the ring until the batch lands or the window closes, and
only then declares its sleep again. The window is 2 * `lead_s` per period, offered only while
that is at most `max_duty` of the period and only once a few regular intervals were seen, so an
idle stream costs nothing.

`WakeTimer` is the precise alarm the window needs: asyncio's and libuv's timers round to whole
milliseconds (a 2 ms step has no room for that), a CLOCK_MONOTONIC timerfd does not; its fd goes
into the same poller as the doorbell. Linux only (ctypes, since Python 3.11 has no
`os.timerfd_create`); `WakeTimer.create()` returns None elsewhere and the reader simply never
anticipates.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import itertools
import math
import os
import time
from collections import deque
from pathlib import Path
from typing import Final

from shm_protocol.ring import RingReader

CLOCK_MONOTONIC: Final = 1  # the clock of time.monotonic() on Linux
TFD_TIMER_ABSTIME: Final = 1


class Cadence:
    """Learns when the next batch of events lands from when recent batches were published
    (time.monotonic() seconds; the ring's `published_at`, which does not depend on how late the
    reader woke to take them).

    A step's events may be published in several flushes microseconds apart (the daemon renders
    a session's requests on more than one detokenizer lane, and each lane's batch is flushed
    when it is done). A publish within `burst_s`, or within `burst_frac` of the period once it
    is known, of its step's first publish belongs to that step: the cadence is that of the
    steps' first publishes, and the reader lingers for the rest of a step (see `linger`).

    The period is the median of the recent intervals (those under a quarter of the longest
    left out: parts of a step not yet grouped) and the prediction the median of the
    recent publishes projected forward by whole periods, so one late or early step moves
    neither. `window(now)` is (start, end) = that prediction -/+ `lead_s`,
    or None while fewer than `min_intervals` intervals were seen or when polling 2 * `lead_s`
    per period would exceed `max_duty` of it (a flood needs no anticipation: its reader is
    never idle). An interval longer than `reset_factor` periods (a pause: the stream ended,
    the engine admitted a long prompt) starts the learning over; one longer than 1.5 periods
    but not a pause counts in `late` (a step that came late: the producer was delayed).
    """

    def __init__(
        self,
        *,
        lead_s: float = 100e-6,
        max_duty: float = 0.25,
        history: int = 8,
        min_intervals: int = 4,
        reset_factor: float = 3.0,
        burst_s: float = 200e-6,
        burst_frac: float = 0.25,
    ) -> None:
        if lead_s <= 0 or not 0 < max_duty <= 1:
            raise ValueError("lead_s must be > 0 and max_duty in (0, 1]")
        if burst_s < 0 or not 0 <= burst_frac < 0.5:
            raise ValueError("burst_s must be >= 0 and burst_frac in [0, 0.5)")
        self.lead_s = lead_s
        self.max_duty = max_duty
        self.min_intervals = max(2, min_intervals)
        self.reset_factor = reset_factor
        self.burst_s = burst_s
        self.burst_frac = burst_frac
        self._times: deque[float] = deque(maxlen=max(history, self.min_intervals) + 1)
        self._period: float | None = None
        self._learned = True
        self._unlearned = 0  # observations since the period was last learned
        self._last_gap: float | None = None  # between the two latest publishes seen
        self._last_t: float | None = None  # the latest publish seen
        self._in_step = 0  # publishes seen in the current step
        self._bursts: deque[tuple[int, float]] = deque(maxlen=history)  # (publishes, spread)
        self.late = 0

    def observe(self, t: float) -> None:
        """A batch was published at `t` (the same publish seen twice counts once)."""
        last = self._last_t
        if last is not None:
            if t <= last:
                return
            self._last_gap = t - last
        self._last_t = t
        times = self._times
        if times:
            period = self._period  # as last learned: observing stays cheap in a flood
            dt = t - times[-1]  # since the current step's first publish
            if dt < max(self.burst_s, self.burst_frac * period if period else 0.0):
                self._in_step += 1  # the same step, flushed in parts
                return
            spread = last - times[-1] if last is not None else 0.0  # the step that ended
            self._bursts.append((self._in_step, spread))
            if period is not None and dt > self.reset_factor * period:
                times.clear()  # a pause, not a step: learn again from here
                self._period = None
            elif period is not None and dt > 1.5 * period:
                self.late += 1
        self._in_step = 1
        times.append(t)
        self._learned = False  # re-learned when a window is asked for, or every 8 batches
        self._unlearned += 1
        if self._unlearned >= 8:
            self._unlearned = 0
            _ = self.period

    @property
    def period(self) -> float | None:
        if not self._learned:
            times = self._times
            if len(times) > self.min_intervals:
                gaps = sorted([b - a for a, b in zip(times, itertools.islice(times, 1, None))])
                # gaps under a quarter of the longest are a step's later parts that were not
                # grouped yet (the period was unknown): the steps are the longer gaps
                steps = gaps[bisect.bisect_left(gaps, 0.25 * gaps[-1]) :]
                self._period = steps[len(steps) // 2]
            self._learned = True
        return self._period

    def expected(self) -> float | None:
        """The predicted time of the next batch, or None while the cadence is unknown."""
        period, times = self.period, self._times
        if period is None:
            return None
        k = len(times)
        projected = sorted([t + (k - i) * period for i, t in enumerate(times)])
        return projected[k // 2]

    def linger(self, max_linger_s: float = 100e-6, now: float | None = None) -> float:
        """How long to keep polling right after taking a batch before declaring a sleep:
        - a flood (the last two batches published less than `max_linger_s` / 4 apart, and no
          longer step period learned): four such gaps, so the next batch lands while we poll
          and the producer skips its doorbell syscall;
        - a step that recent steps published in several parts, while fewer parts were seen:
          until its usual spread (+25%, at most `burst_s`) past its first publish, so the rest
          of the step lands without a doorbell each;
        - 0 otherwise: a decode cadence is served by `window`."""
        gap, period = self._last_gap, self._period
        # a step's parts come as close together as a flood's batches, but a period apart
        flood = period is None or period <= 2 * self.burst_s
        if gap is not None and 4 * gap <= max_linger_s and flood:
            return 4 * gap
        bursts, times = self._bursts, self._times
        if not bursts or not times:
            return 0.0
        parts = max(b[0] for b in bursts)
        if self._in_step >= parts:
            return 0.0
        spread = max(b[1] for b in bursts)
        end = times[-1] + min(1.25 * spread, self.burst_s)
        left = end - (time.monotonic() if now is None else now)
        return max(left, 0.0)

    def window(self, now: float) -> tuple[float, float] | None:
        """(start, end) to poll in for the next batch, or None: sleep until the doorbell."""
        expected = self.expected()
        if expected is None or self._period is None:
            return None
        if 2 * self.lead_s > self.max_duty * self._period:
            return None
        end = expected + self.lead_s
        if end <= now:
            return None  # overdue: the doorbell will say when
        return max(expected - self.lead_s, now), end


def cgroup_cpu_limit(
    root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> float | None:
    """CPUs allowed by this process's cgroup v2 `cpu.max` quota, or None when unlimited or
    unreadable (cgroup v1, no quota)."""
    try:
        line = membership.read_text().splitlines()
        rel = next(x.split("::", 1)[1] for x in line if x.startswith("0::"))
        quota, period = (root / rel.lstrip("/") / "cpu.max").read_text().split()[:2]
    except (OSError, StopIteration, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return max(int(quota) / int(period), 1.0)
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a
    container with 16 visible cores and a 2-CPU quota has 2). Whether polling may spend one of
    them decides anticipation (libflare_client) and the daemon's tensor thread pool."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return min(n, math.ceil(limit)) if limit is not None else n


def poll_until(ring: RingReader, end: float) -> bool:
    """Poll `ring` until a record is published (True) or time.monotonic() reaches `end`
    (False), yielding the CPU each turn: a producer woken onto this CPU runs at once instead of
    after the poll (on a 2-CPU host it otherwise published just after every window closed)."""
    pending, now, yield_cpu = ring.pending, time.monotonic, os.sched_yield
    while not pending():
        if now() >= end:
            return False
        yield_cpu()
    return True


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class WakeTimer:
    """A one-shot CLOCK_MONOTONIC timerfd, armed at absolute time.monotonic() instants."""

    def __init__(self, libc: ctypes.CDLL) -> None:
        self._settime = libc.timerfd_settime
        self._settime.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        self._settime.restype = ctypes.c_int
        create = libc.timerfd_create
        create.argtypes = [ctypes.c_int, ctypes.c_int]
        create.restype = ctypes.c_int
        fd = create(CLOCK_MONOTONIC, os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd: int = int(fd)
        self._spec = _Itimerspec()
        self.armed = False

    @classmethod
    def create(cls) -> WakeTimer | None:
        """A timer, or None where timerfd is unavailable (the reader then never anticipates)."""
        try:
            return cls(ctypes.CDLL(None, use_errno=True))
        except (OSError, AttributeError):
            return None

    def arm_at(self, t: float) -> None:
        """Fire once at monotonic time `t` (at once if `t` has passed)."""
        sec = int(t)
        value = self._spec.it_value
        value.tv_sec, value.tv_nsec = sec, max(1, int((t - sec) * 1e9))
        if self._settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self.armed = True

    def disarm(self) -> None:
        if self.armed:
            value = self._spec.it_value
            value.tv_sec = value.tv_nsec = 0
            self._settime(self.fd, 0, ctypes.byref(self._spec), None)
            self.armed = False

    def clear(self) -> bool:
        """Consume an expiry (the fd polls readable until then). False when there was none: a
        readiness the poller reported before the timer was re-armed (`arm_at` discards a pending
        expiry), so the window it belonged to is gone; the caller must not act on it."""
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            return False
        self.armed = False
        return True

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1
