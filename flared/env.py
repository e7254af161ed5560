"""Every environment variable Flare's daemon and CLI read, declared in one place.

The socket-path variables are defined in shm_protocol.paths (the client needs them and cannot
import flared) and re-exported here.
"""

from __future__ import annotations

import os
from typing import Final

from shm_protocol.paths import FLARE_SOCKET, INVOCATION_ID, XDG_RUNTIME_DIR

# systemd socket activation (sd_listen_fds(3)): fds start at 3; only for the named pid.
LISTEN_FDS: Final = "LISTEN_FDS"
LISTEN_PID: Final = "LISTEN_PID"
LISTEN_FDNAMES: Final = "LISTEN_FDNAMES"
SD_LISTEN_FDS_START: Final = 3
# systemd readiness notification (sd_notify(3)): READY=1 / STOPPING=1 datagrams.
NOTIFY_SOCKET: Final = "NOTIFY_SOCKET"
# systemd watchdog (sd_watchdog_enabled(3)); read by flared/sdnotify.py.
WATCHDOG_USEC: Final = "WATCHDOG_USEC"
WATCHDOG_PID: Final = "WATCHDOG_PID"
# log level name for the daemon (DEBUG, INFO, WARNING); default INFO.
FLARE_LOG_LEVEL: Final = "FLARE_LOG_LEVEL"
# where `flare demo` caches the tiny model and bundle; default $XDG_CACHE_HOME/flare or ~/.cache/flare.
XDG_CACHE_HOME: Final = "XDG_CACHE_HOME"
FLARE_CACHE_DIR: Final = "FLARE_CACHE_DIR"
# OpenMP's thread count; when set, the daemon keeps it for the engine (flared/daemon_threads.py).
OMP_NUM_THREADS: Final = "OMP_NUM_THREADS"

__all__ = [
    "FLARE_CACHE_DIR",
    "FLARE_LOG_LEVEL",
    "FLARE_SOCKET",
    "INVOCATION_ID",
    "LISTEN_FDNAMES",
    "LISTEN_FDS",
    "LISTEN_PID",
    "NOTIFY_SOCKET",
    "OMP_NUM_THREADS",
    "SD_LISTEN_FDS_START",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
    "XDG_CACHE_HOME",
    "XDG_RUNTIME_DIR",
    "get",
    "pop",
]


def get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def pop(name: str) -> str | None:
    return os.environ.pop(name, None)
