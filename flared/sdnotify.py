"""sd_notify(3) without libsystemd: datagrams of NEWLINE-separated KEY=VALUE to $NOTIFY_SOCKET.

The daemon sends READY=1 once the bundle is loaded and every prepared execution is captured,
STOPPING=1 when it starts draining, STATUS=<text> for `systemctl status`, and WATCHDOG=1 from
flared.watchdog. Outside systemd ($NOTIFY_SOCKET unset) every call is a no-op returning False.

$NOTIFY_SOCKET is a filesystem path or, with a leading "@", a Linux abstract socket name.
Sending never raises: a full or vanished notification socket must not take the daemon down
(systemd's own sd_notify returns an error code that callers ignore for the same reason).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

from flared import env

log = logging.getLogger("flared.sdnotify")

# sd_watchdog_enabled(3): the interval in microseconds, and the pid it applies to (if set).
WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"


class Notifier:
    """One notification socket. Build with Notifier.from_env() in the daemon."""

    def __init__(self, address: str | None) -> None:
        self.address = address or None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if environ is None else environ
        return cls(environ.get(env.NOTIFY_SOCKET))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send KEY=VALUE assignments in one datagram; True if systemd got it."""
        if self.address is None:
            return False
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        payload = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(payload, target)
        except OSError as exc:
            log.debug("sd_notify to %s failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", f"MAINPID={os.getpid()}", *_status(status))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more of TimeoutStartSec/TimeoutStopSec from now (long loads)."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def status(self, text: str) -> bool:
        return self.notify(*_status(text))

    def mainpid(self, pid: int) -> bool:
        return self.notify(f"MAINPID={pid}")


def _status(text: str | None) -> list[str]:
    # STATUS is one line: a newline would start a new assignment
    return [] if text is None else ["STATUS=" + " ".join(text.splitlines())]


def watchdog_interval_s(environ: Mapping[str, str] | None = None) -> float | None:
    """The WatchdogSec= timeout in seconds if systemd expects pings from this process, else
    None (unset, malformed, zero, or meant for another pid)."""
    environ = os.environ if environ is None else environ
    usec = environ.get(WATCHDOG_USEC, "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = environ.get(WATCHDOG_PID)
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6
