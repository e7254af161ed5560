"""A process's own peak resident memory, as prep and the daemon report it."""

from __future__ import annotations

import contextlib
import resource


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident memory since it began its program: the
    kernel's VmHWM (Linux). Not getrusage's ru_maxrss, which an exec carries over: a process
    started by a large parent (a benchmark that built a model in host memory) would report the
    parent's peak as its own. Elsewhere, ru_maxrss (KiB on Linux and the BSDs)."""
    with (
        contextlib.suppress(OSError, ValueError, IndexError),  # no /proc: the fallback
        open("/proc/self/status", encoding="ascii", errors="replace") as fh,
    ):
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
