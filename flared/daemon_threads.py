"""How many CPU threads the engine's tensor math may use inside the daemon.

Why this is not torch's default: torch sizes its intra-op pool (OpenMP) to every core. Each
parallel op is a team that must meet at a barrier, and a team member that waits there spins
before it sleeps. In the daemon the engine is not alone: the event loop, the detokenizer lanes
and the local clients must run once per token. When the team spans every core, each of those
wake-ups preempts a team member, the op's barrier waits until it is scheduled again, and the
spinning members burn the share its process would need. On a loaded 2-core machine this turned
a 4 ms CPU decode step into 100-500 ms through the daemon while the same engine in a bare
process stayed at ~20 ms (benchmarks/transport_daemon.py).

Policy: leave `RESERVED_CORES` for the daemon's own threads, i.e. the team gets the usable CPUs
(affinity, capped by a cgroup v2 CPU quota) minus one, at least one. An explicit
`OMP_NUM_THREADS` is the operator's choice and is kept. On CUDA the engine's host work is a
few small tensors, so the cap changes nothing there; it is applied the same way for one rule.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Final

from flared import env
from shm_protocol.cadence import cgroup_cpu_limit, usable_cpus

__all__ = ["cgroup_cpu_limit", "configure_engine_threads", "engine_cpu_threads", "usable_cpus"]

RESERVED_CORES: Final = 1  # the event loop, the detokenizer lanes, local clients
PR_SET_NAME: Final = 15  # prctl: the calling thread's name, as top -H and /proc show it
_LIBC: list[ctypes.CDLL | None] = []


def name_native_thread(name: str | None = None) -> None:
    """Give the calling OS thread `name` (default: its Python thread's name; 15 bytes kept) so
    per-thread CPU in `top -H`, `ps -L` and /proc/PID/task tells the engine, the detokenizer
    lanes and the front-end workers apart from the tensor library's pool. Linux only; a no-op
    elsewhere. Also a ThreadPoolExecutor `initializer`."""
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    libc = _LIBC[0]
    prctl = getattr(libc, "prctl", None)
    if prctl is None:
        return
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:15]
    prctl(PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)


def engine_cpu_threads(cpus: int, explicit: str | None) -> int | None:
    """The intra-op thread count for the engine, or None to keep an explicit operator setting
    (`explicit` is the OMP_NUM_THREADS value, if any)."""
    if explicit and explicit.strip():
        return None
    return max(1, cpus - RESERVED_CORES)


def configure_engine_threads() -> int:
    """Apply the policy before the engine's thread starts (a thread takes the count when it
    first runs a parallel op); returns the count in effect."""
    import torch

    threads = engine_cpu_threads(usable_cpus(), env.get(env.OMP_NUM_THREADS))
    if threads is not None:
        torch.set_num_threads(threads)
    return int(torch.get_num_threads())
