"""The systemd watchdog pinger: WATCHDOG=1 every timeout/2, only while the engine loop moves.

A thread that pings unconditionally proves only that the process is alive; a wedged CUDA call
or a deadlocked engine loop would look healthy forever. So each ping is gated on `progress()`:
a counter the engine loop advances on every iteration — after a completed step and after each
idle wait alike (idle-healthy). If it has not changed since the previous ping, the ping is
skipped; after WatchdogSec without a ping systemd kills the service (SIGABRT, so there is a
core/traceback) and Restart=on-failure brings it back.

Invariant: a ping is sent at tick k only if progress() at tick k differs from its value at the
last tick that sent a ping (or at start).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from flared.sdnotify import Notifier, watchdog_interval_s

log = logging.getLogger("flared.watchdog")


@dataclass(frozen=True)
class WatchdogPlan:
    timeout_s: float  # WatchdogSec as systemd told us (WATCHDOG_USEC)

    @property
    def interval_s(self) -> float:
        # sd_watchdog_enabled(3): ping at half the timeout, so one late tick is survivable
        return self.timeout_s / 2


class Watchdog:
    """Start with Watchdog.from_env(...) (None when systemd set no watchdog); stop() on exit."""

    def __init__(
        self, notifier: Notifier, progress: Callable[[], Hashable], plan: WatchdogPlan
    ) -> None:
        self.notifier = notifier
        self.progress = progress
        self.plan = plan
        self.num_pings = 0
        self.num_consecutive_skips = 0
        self._stop = threading.Event()
        self._last: Hashable = object()  # differs from any first reading: the first tick pings
        self._thread = threading.Thread(target=self._run, name="flare-watchdog", daemon=True)

    @classmethod
    def from_env(cls, notifier: Notifier, progress: Callable[[], Hashable]) -> Watchdog | None:
        timeout_s = watchdog_interval_s()
        if timeout_s is None or not notifier.enabled:
            return None
        return cls(notifier, progress, WatchdogPlan(timeout_s))

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def tick(self) -> bool:
        """One interval's decision; True if a ping was sent. Public for tests."""
        try:
            now = self.progress()
        except Exception:  # a broken progress probe is a wedged engine, not a crash here
            log.exception("watchdog progress probe failed")
            now = self._last
        if now == self._last:
            self.num_consecutive_skips += 1
            if self.num_consecutive_skips == 1:
                log.warning("engine loop made no progress for %.1f s", self.plan.interval_s)
            return False
        self._last = now
        self.num_consecutive_skips = 0
        self.num_pings += 1
        return self.notifier.watchdog()

    def _run(self) -> None:
        self.tick()
        while not self._stop.wait(self.plan.interval_s):
            self.tick()
