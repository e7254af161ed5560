"""Single-producer single-consumer byte ring over a shared mapping.

Region map of a ring segment (all integers little-endian):

    0   .. 64        magic u32 | version u16 | slot_bytes u16 | capacity u64   (daemon-written)
    64  .. 72        head u64: producer's byte position (monotonic, never wraps)
    128 .. 136       tail u64: consumer's byte position (monotonic, never wraps)
    192 .. 192+cap   data; byte position p lives at data[p % cap]

A record is a u32 payload length followed by the payload, padded to a whole number of
`SLOT_BYTES` slots, and may wrap around the end of the data region (split copy). Positions are
always slot-aligned. Invariant kept by each side: tail <= head <= tail + capacity.

Trust: the mapping is shared with a client that may write anything, so every index and length
read from it is validated against this side's private copy before use; a violation raises
`RingCorrupt` (a ProtocolViolation) and the caller ends that session. Each side writes only its
own index. Segments are sealed memfds (see segment.py), so the mapping cannot shrink under us.

Memory ordering (ARM64 included): the producer writes record bytes, executes `fence()`, stores
head, and only then rings the doorbell (a socket send); the consumer reads head after the
doorbell's recv (or after `fence()` on a timed re-check), copies the records out, executes
`fence()`, then stores tail. `fence()` is a lock acquire/release, which POSIX lists among the
memory-synchronising functions (and CPython implements with sem_t / pthread primitives); the
socket syscalls are full barriers. A stale tail only delays the producer, never corrupts.
"""

from __future__ import annotations

import struct
import threading
from typing import Final

from shm_protocol.codec import ProtocolViolation

MAGIC: Final = 0x47524C46  # b"FLRG"
VERSION: Final = 1
SLOT_BYTES: Final = 64
HEAD_OFFSET: Final = 64
TAIL_OFFSET: Final = 128
DATA_OFFSET: Final = 192
LEN_BYTES: Final = 4

_META = struct.Struct("<IHHQ")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_FENCE = threading.Lock()


class RingCorrupt(ProtocolViolation):
    """An index or length read from shared memory is impossible; the peer is broken or hostile."""


def _u64(buf: memoryview, offset: int) -> int:
    return int(_U64.unpack_from(buf, offset)[0])


def fence() -> None:
    """A full memory barrier (lock acquire + release)."""
    with _FENCE:
        pass


def record_bytes(payload_len: int) -> int:
    """Ring bytes one record of `payload_len` occupies (header + payload, slot-aligned)."""
    n = LEN_BYTES + payload_len
    return -(-n // SLOT_BYTES) * SLOT_BYTES


def segment_bytes(capacity: int) -> int:
    return DATA_OFFSET + capacity


def check_capacity(capacity: int) -> int:
    if capacity < 2 * SLOT_BYTES or capacity & (capacity - 1):
        raise ValueError(
            f"ring capacity must be a power of two >= {2 * SLOT_BYTES}, got {capacity}"
        )
    return capacity


def init_header(buf: memoryview, capacity: int) -> None:
    """Format a fresh segment (daemon side only)."""
    check_capacity(capacity)
    _META.pack_into(buf, 0, MAGIC, VERSION, SLOT_BYTES, capacity)
    _U64.pack_into(buf, HEAD_OFFSET, 0)
    _U64.pack_into(buf, TAIL_OFFSET, 0)


def read_capacity(buf: memoryview) -> int:
    """Validate a mapped segment's header and return its capacity (client side)."""
    if len(buf) < DATA_OFFSET:
        raise RingCorrupt(f"ring segment of {len(buf)} bytes is smaller than its header")
    magic, version, slot, capacity = _META.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or slot != SLOT_BYTES:
        raise RingCorrupt(f"not a version-{VERSION} Flare ring (magic {magic:#x}, v{version})")
    if capacity < 2 * SLOT_BYTES or capacity & (capacity - 1) or segment_bytes(capacity) > len(buf):
        raise RingCorrupt(f"ring capacity {capacity} does not fit a {len(buf)}-byte segment")
    return int(capacity)


class _RingSide:
    def __init__(self, buf: memoryview, capacity: int, max_payload_bytes: int | None) -> None:
        self._buf = buf
        self.capacity = check_capacity(capacity)
        self._data = buf[DATA_OFFSET : DATA_OFFSET + capacity]
        limit = capacity - LEN_BYTES
        self.max_payload_bytes = (
            limit if max_payload_bytes is None else min(max_payload_bytes, limit)
        )

    def _copy_in(self, pos: int, data: bytes | memoryview) -> None:
        off = pos % self.capacity
        first = min(len(data), self.capacity - off)
        self._data[off : off + first] = data[:first]
        if first < len(data):
            self._data[: len(data) - first] = data[first:]

    def _copy_out(self, pos: int, n: int) -> bytes:
        off = pos % self.capacity
        first = min(n, self.capacity - off)
        out = bytes(self._data[off : off + first])
        if first < n:
            out += bytes(self._data[: n - first])
        return out

    def release(self) -> None:
        self._data.release()


class RingWriter(_RingSide):
    """Producer side. Pushed records become visible to the consumer only at `publish()`."""

    def __init__(
        self, buf: memoryview, capacity: int, max_payload_bytes: int | None = None, start: int = 0
    ) -> None:
        # positions start from what this side knows (a freshly formatted segment: 0), never
        # from the mapping: the peer may already have scribbled over the header
        super().__init__(buf, capacity, max_payload_bytes)
        self._head = self._published = self._tail = start

    @property
    def head(self) -> int:
        return self._published

    def refresh_tail(self) -> int:
        """Re-read the consumer's tail; it may only move forward, up to what was published."""
        fence()
        tail = _u64(self._buf, TAIL_OFFSET)
        if not self._tail <= tail <= self._published or tail % SLOT_BYTES:
            raise RingCorrupt(
                f"ring tail {tail} outside [{self._tail}, {self._published}] or misaligned"
            )
        self._tail = tail
        return tail

    def free_bytes(self) -> int:
        return self.capacity - (self._head - self._tail)

    def try_push(self, payload: bytes | memoryview) -> bool:
        """Append one record unpublished; False (and nothing written) when it does not fit."""
        if len(payload) > self.max_payload_bytes:
            raise ValueError(f"record of {len(payload)} bytes exceeds {self.max_payload_bytes}")
        size = record_bytes(len(payload))
        if size > self.free_bytes() and size > self.capacity - (self._head - self.refresh_tail()):
            return False
        self._copy_in(self._head, _U32.pack(len(payload)))
        if payload:
            self._copy_in(self._head + LEN_BYTES, payload)
        self._head += size
        return True

    def publish(self) -> int:
        """Make every pushed record visible; returns the published head. Ring the doorbell after."""
        if self._head != self._published:
            fence()  # record bytes before the head store
            _U64.pack_into(self._buf, HEAD_OFFSET, self._head)
            self._published = self._head
        return self._published

    def rollback(self) -> None:
        """Drop records pushed since the last publish (the consumer never saw them)."""
        self._head = self._published

    @property
    def empty(self) -> bool:
        """True once the consumer has taken everything published (as of the last refresh)."""
        return self._tail == self._published


class RingReader(_RingSide):
    """Consumer side."""

    def __init__(
        self, buf: memoryview, capacity: int, max_payload_bytes: int | None = None, start: int = 0
    ) -> None:
        super().__init__(buf, capacity, max_payload_bytes)
        self._tail = start  # see RingWriter: never initialised from the mapping

    @property
    def tail(self) -> int:
        return self._tail

    def _load_head(self) -> int:
        fence()
        head = _u64(self._buf, HEAD_OFFSET)
        if not self._tail <= head <= self._tail + self.capacity or head % SLOT_BYTES:
            raise RingCorrupt(
                f"ring head {head} outside [{self._tail}, {self._tail + self.capacity}] "
                "or misaligned"
            )
        return int(head)

    def _take(self, head: int) -> bytes:
        avail = head - self._tail
        if avail < LEN_BYTES:
            raise RingCorrupt(f"{avail} published bytes cannot hold a record header")
        n = int(_U32.unpack(self._copy_out(self._tail, LEN_BYTES))[0])
        if n > self.max_payload_bytes or record_bytes(n) > avail:
            raise RingCorrupt(f"record length {n} exceeds the {avail} published bytes or limit")
        payload = self._copy_out(self._tail + LEN_BYTES, n)
        self._tail += record_bytes(n)
        return payload

    def _store_tail(self) -> None:
        fence()  # record reads complete before the producer may reuse the space
        _U64.pack_into(self._buf, TAIL_OFFSET, self._tail)

    def pop(self) -> bytes | None:
        """Take the next published record, or None when the ring is empty."""
        head = self._load_head()
        if head == self._tail:
            return None
        payload = self._take(head)
        self._store_tail()
        return payload

    def drain(self, max_records: int | None = None) -> list[bytes]:
        """Take every published record (at most `max_records`)."""
        head = self._load_head()
        out: list[bytes] = []
        while self._tail < head and (max_records is None or len(out) < max_records):
            out.append(self._take(head))
        if out:
            self._store_tail()
        return out
