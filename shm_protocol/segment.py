"""Shared-memory segments as sealed memfds (Linux), created by the daemon only.

Why memfd: it has no name (nothing in /dev/shm to squat, guess or leak; it disappears with the
last fd and mapping, so a killed daemon leaves no stale segment behind), and its size is fixed
by seals (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL), so a client cannot ftruncate it and make
the daemon's mapping fault (SIGBUS). The fd travels to the client over the Unix socket with
SCM_RIGHTS and is closed on both sides once mapped.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from dataclasses import dataclass
from typing import Final

from shm_protocol.ring import RingCorrupt, init_header, read_capacity, segment_bytes

SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


@dataclass
class Segment:
    """A mapped ring segment. `view` is valid until `close()`."""

    mapping: mmap.mmap
    view: memoryview
    capacity: int

    def close(self) -> None:
        self.view.release()
        self.mapping.close()


def create_ring_segment(name: str, capacity: int) -> tuple[int, Segment]:
    """Create, size, format and seal a ring segment. Returns (fd, segment); the caller sends
    the fd to the client and closes it."""
    size = segment_bytes(capacity)
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    view = memoryview(mapping)
    init_header(view, capacity)
    return fd, Segment(mapping, view, capacity)


def map_ring_segment(fd: int, expected_capacity: int) -> Segment:
    """Map a segment received from the daemon. The fd is consumed (closed) either way."""
    try:
        size = os.fstat(fd).st_size
        if size != segment_bytes(expected_capacity):
            raise RingCorrupt(
                f"ring segment is {size} bytes, expected {segment_bytes(expected_capacity)}"
            )
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    view = memoryview(mapping)
    try:
        capacity = read_capacity(view)
    except RingCorrupt:
        view.release()
        mapping.close()
        raise
    return Segment(mapping, view, capacity)
