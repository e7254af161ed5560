"""Single-producer single-consumer byte ring over a shared mapping, with coalesced doorbells.

Region map of a ring segment:

    0   .. 64        magic u32 | version u16 | slot_bytes u16 | capacity u64   (daemon-written,
                     little-endian, never re-read after the client validated it)
    64  .. 72        head u64: producer's published byte position (monotonic, never wraps)
    72  .. 80        published_ns u64: CLOCK_MONOTONIC nanoseconds of the latest publish (a hint
                     for the reader's anticipation, cadence.py; never used as an index)
    128 .. 136       tail u64: consumer's byte position (monotonic, never wraps)
    136 .. 144       sleeps u64: consumer's sleep word: odd = asleep (a new odd value before every
                     doorbell wait), even = awake (polling; no doorbell wanted)
    192 .. 192+cap   data; byte position p lives at data[p % cap]

The producer's line (64..128) and the consumer's line (128..192) are separate cache lines; each
side writes only its own. Index words are native-order (little-endian on every supported
platform) aligned u64s accessed through a `memoryview.cast("Q")`, i.e. one aligned 8-byte
load or store each (an 8-byte memcpy, which compilers emit as a single access), so neither side
can observe a torn index.

A record is a u32 payload length followed by the payload, padded to a whole number of
`SLOT_BYTES` slots, and may wrap around the end of the data region (split copy). Positions are
always slot-aligned. Invariant kept by each side: tail <= head <= tail + capacity.

Trust: the mapping is shared with a client that may write anything, so every index and length
read from it is validated against this side's private copy before use; a violation raises
`RingCorrupt` (a ProtocolViolation) and the caller ends that session. The sleeps word is only
ever tested for parity and compared for change, so any value a hostile reader writes there
costs at most one doorbell per publish. Positions and counters start from what each side knows
(0 for a fresh segment), never from the mapping. Segments are sealed memfds (segment.py): the mapping cannot shrink.

Batching: `push_batch` writes many records with one copy, `drain` copies every published
record out with one (or, across the wrap, two) copies and hands back zero-copy memoryview
slices of that private copy, so decoding never reads memory the peer can still change.

Doorbells (coalesced wake-ups; the doorbell itself is a pipe byte or a socket frame, see
doorbell.py): the consumer declares "about to sleep" by storing a new odd `sleeps` value, then
re-checks head before it waits; the producer, after publishing, rings only when `sleeps` is odd
and changed since the last doorbell it sent. A consumer that wakes early to poll for records it
expects (`wake()`, see cadence.py) stores the next even value first, so the producer skips the
doorbell syscall while it polls; a doorbell racing that store is merely spurious. This is
Dekker's pattern, so both sides need a full barrier between their store and their load:

    producer: store records; [fence]; store head; fence; load sleeps  -> ring if changed
    consumer: store sleeps;                      fence; load head     -> sleep only if empty

At least one side sees the other's store, so a wake-up is never lost; a consumer that reads
records after a spurious doorbell just finds nothing. Every wait still has a timeout, after
which the consumer re-checks the ring, so even a broken barrier could only add latency.

Memory ordering (ARM64 included): `fence()` is two uncontended round trips on one lock. A lock
release is a store-release and the next acquire a load-acquire (CPython's locks are sem_t /
pthread primitives, which POSIX lists as memory-synchronising), and ARMv8 orders a
store-release before a later load-acquire (RCsc), so every access before the fence is ordered
before every access after it, stores before loads included. On x86 each locked instruction is a
full barrier by itself, so there one round trip suffices. Publication: producer writes record
bytes, fence, stores head; consumer loads head, fence, copies records, fence, stores tail. A
stale tail only delays the producer. Those three publication fences order store->store,
load->load and load->store, which x86 (TSO) never reorders, so they are taken only where the
CPU may reorder (`WEAK_ORDER`: every platform but x86); the two Dekker fences (store->load) are
taken everywhere. The interpreter cannot reorder either: each access is its own C call. One x86
exception: memcpy may switch to non-temporal stores, which TSO does not order, for large copies,
so a publish of `LARGE_COPY_BYTES` or more takes the fence on x86 too.

Compiled publish: the daemon's per-step publish of one event (`RingWriter.publish_one`) is one
C call where setup.py built `_ringfast.c` (`COMPILED_PUBLISH`): the same accesses in the same
order and the same validation, with C11 atomics for the ordering (the head a store-release, a
sequentially consistent fence before the sleeps load) instead of lock round trips. Where it
was not built (no C compiler or Python headers), the Python path above does the same.
"""

from __future__ import annotations

import platform
import struct
import sys
import threading
from collections.abc import Iterable
from time import monotonic_ns
from typing import Final

from shm_protocol.codec import ProtocolViolation, array_header

try:  # the compiled one-event publish (setup.py builds it where a C compiler is found)
    from shm_protocol import _ringfast
except ImportError:  # pragma: no cover - exercised where the extension is not built
    _ringfast = None  # type: ignore[assignment]

MAGIC: Final = 0x47524C46  # b"FLRG"
VERSION: Final = 3  # 3: odd/even sleeps word; event records are batches (outbox.py)
SLOT_BYTES: Final = 64
HEAD_OFFSET: Final = 64
PUBLISHED_NS_OFFSET: Final = 72
TAIL_OFFSET: Final = 128
SLEEPS_OFFSET: Final = 136
DATA_OFFSET: Final = 192
LEN_BYTES: Final = 4
LARGE_COPY_BYTES: Final = 1 << 16  # far below any memcpy's non-temporal threshold
NOT_WRITTEN: Final = -1  # RingWriter.publish_array: the record does not fit

_HEAD: Final = HEAD_OFFSET // 8  # word indices into the header's u64 view
_PUBLISHED_NS: Final = PUBLISHED_NS_OFFSET // 8
_TAIL: Final = TAIL_OFFSET // 8
_SLEEPS: Final = SLEEPS_OFFSET // 8

_META = struct.Struct("<IHHQ")
# the compiled publish where its build assumes this layout (a stale build is not used)
_LAYOUT: Final = (SLOT_BYTES, LEN_BYTES, HEAD_OFFSET, PUBLISHED_NS_OFFSET, TAIL_OFFSET,
                  SLEEPS_OFFSET, DATA_OFFSET, LARGE_COPY_BYTES)  # fmt: skip
_publish_one_c = (
    _ringfast.publish_one
    if _ringfast is not None and getattr(_ringfast, "LAYOUT", None) == _LAYOUT
    else None
)
_U32 = struct.Struct("<I")
_LEN_FIXARRAY = struct.Struct("<IB")  # a record's length word + a msgpack fixarray header
# a one-event record (length word, fixarray header, the event) as one struct per event size:
# the common publish (one stream's token) is then a single pack_into
_ONE_RECORD_MAX: Final = 256
_ONE_RECORDS: dict[int, struct.Struct] = {}


def _new_one_record(nbytes: int) -> struct.Struct:
    packer = _ONE_RECORDS[nbytes] = struct.Struct(f"<IB{nbytes}s")
    return packer


_FENCE = threading.Lock()
_FENCE_ACQUIRE, _FENCE_RELEASE = _FENCE.acquire, _FENCE.release  # bound once: half a `with`'s cost
_PADS: Final = [bytes(n) for n in range(SLOT_BYTES)]
_X86: Final = frozenset({"x86_64", "amd64", "i386", "i686"})

if sys.byteorder != "little":  # the header words are native-order; the format says little
    raise ImportError("the Flare ring format needs a little-endian host")


class RingCorrupt(ProtocolViolation):
    """An index or length read from shared memory is impossible; the peer is broken or hostile."""


def _fence_x86() -> None:
    _FENCE_ACQUIRE()  # the acquire's locked RMW alone is a full barrier on x86
    _FENCE_RELEASE()


def _fence_release_acquire() -> None:
    with _FENCE:
        pass
    with _FENCE:  # this acquire follows the release above: RCsc makes the pair a full fence
        pass


WEAK_ORDER: Final = platform.machine().lower() not in _X86  # may reorder more than x86-TSO
COMPILED_PUBLISH: Final = _publish_one_c is not None  # RingWriter.publish_one runs in C
fence: Final = _fence_release_acquire if WEAK_ORDER else _fence_x86
fence.__doc__ = "A full memory barrier (see the module docstring)."


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
    buf[:DATA_OFFSET] = bytes(DATA_OFFSET)
    _META.pack_into(buf, 0, MAGIC, VERSION, SLOT_BYTES, capacity)


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
        self.capacity = check_capacity(capacity)
        if len(buf) < segment_bytes(capacity):
            raise RingCorrupt(f"a {len(buf)}-byte mapping cannot hold a {capacity}-byte ring")
        self._words = buf[:DATA_OFFSET].cast("Q")
        self._data = buf[DATA_OFFSET : DATA_OFFSET + capacity]
        limit = capacity - LEN_BYTES
        self.max_payload_bytes = (
            limit if max_payload_bytes is None else min(max_payload_bytes, limit)
        )

    def release(self) -> None:
        self._words.release()
        self._data.release()


class RingWriter(_RingSide):
    """Producer side. Pushed records become visible to the consumer only at `publish()`."""

    def __init__(
        self, buf: memoryview, capacity: int, max_payload_bytes: int | None = None, start: int = 0
    ) -> None:
        super().__init__(buf, capacity, max_payload_bytes)
        self._head = self._published = self._tail = start
        self._sleeps_seen: int | None = None  # None: the first publish always rings

    @property
    def head(self) -> int:
        return self._published

    def refresh_tail(self) -> int:
        """Re-read the consumer's tail; it may only move forward, up to what was published.
        No barrier is needed after the load: every later write into the space it frees is
        control-dependent on the validated value, and no CPU makes a store visible before a
        load it depends on (ARMv8 included)."""
        tail = self._words[_TAIL]
        if not self._tail <= tail <= self._published or tail % SLOT_BYTES:
            raise RingCorrupt(
                f"ring tail {tail} outside [{self._tail}, {self._published}] or misaligned"
            )
        self._tail = tail
        return int(tail)

    def free_bytes(self) -> int:
        return self.capacity - (self._head - self._tail)

    def room(self, need: int = 0) -> int:
        """The largest payload one record could carry now, within the payload limit. The tail
        is re-read only when the space known from the last read is less than `need`."""
        free = self.capacity - (self._head - self._tail)
        if free - LEN_BYTES < need:
            self.refresh_tail()
            free = self.capacity - (self._head - self._tail)
        return max(0, min(self.max_payload_bytes, free - LEN_BYTES))  # free is slot-aligned

    def push_array(self, payloads: list[bytes], nbytes: int, publish: bool = False) -> bool:
        """Append one record holding `payloads` (each one encoded msgpack object, `nbytes` in
        all) as one msgpack array, with one copy into the ring, and with `publish` publish it
        (and anything pushed before) in the same call; False (nothing written) when it does not
        fit. The event ring's per-flush fast path (outbox.py): the length word and a short
        array's header are packed in one call."""
        count = len(payloads)
        if count < 16:  # a fixarray: the length word and the header in one pack
            n = 1 + nbytes
            first = _LEN_FIXARRAY.pack(n, 0x90 | count)
        else:
            header = array_header(count)
            n = len(header) + nbytes
            first = _U32.pack(n) + header
        size = (n + LEN_BYTES + SLOT_BYTES - 1) & -SLOT_BYTES
        if n > self.max_payload_bytes:
            return False
        head = self._head
        if size > self.capacity - (head - self._tail):
            self.refresh_tail()
            if size > self.capacity - (head - self._tail):
                return False
        self._write(b"".join([first, *payloads, _PADS[size - LEN_BYTES - n]]), size)
        if publish:
            self.publish()
        return True

    def publish_array(self, payloads: list[bytes], nbytes: int) -> int:
        """`push_array` with publish, then `reader_slept`, in one call: the event ring's
        per-step path (outbox.py `Outbox.flush_check`), where a flood of one-event steps makes
        the producer's per-call cost its throughput. Returns NOT_WRITTEN (-1: it does not fit,
        nothing written), 0 (published; the reader is awake or was already rung) or 1
        (published; ring its doorbell). The same accesses in the same order as the three calls
        (record bytes, [fence], head; fence; sleeps and tail loads), the tail validated as
        `refresh_tail` does. Written out rather than composed of those calls: a version that
        shared push_array's write cost 0.18 µs more per one-event step (2.46 against 2.28 on the
        development machine), most of what the one call saves. A one-event record under 256
        bytes is packed by one cached struct (1.53 against 1.80 µs per call there)."""
        count = len(payloads)
        if count == 1 and _publish_one_c is not None:  # one event: the compiled publish
            return self.publish_one(payloads[0])
        if count >= 16 or WEAK_ORDER:
            if not self.push_array(payloads, nbytes, True):
                return NOT_WRITTEN
            return int(self.reader_slept())
        n = 1 + nbytes
        size = (n + LEN_BYTES + SLOT_BYTES - 1) & -SLOT_BYTES
        head, cap = self._head, self.capacity
        if n > self.max_payload_bytes:
            return NOT_WRITTEN
        if size > cap - (head - self._tail):
            self.refresh_tail()
            if size > cap - (head - self._tail):
                return NOT_WRITTEN
        off = head % cap
        data = self._data
        if count == 1 and nbytes < _ONE_RECORD_MAX and off + size <= cap:
            (_ONE_RECORDS.get(nbytes) or _new_one_record(nbytes)).pack_into(
                data, off, n, 0x91, payloads[0]
            )  # the whole record in one C call (0x91: a fixarray of one)
        elif count <= 2 and off + size <= cap:  # packed in place: no joined copy (the padding
            _LEN_FIXARRAY.pack_into(data, off, n, 0x90 | count)  # is never read)
            pos = off + LEN_BYTES + 1
            for payload in payloads:
                end = pos + len(payload)
                data[pos:end] = payload
                pos = end
        else:
            head_bytes = _LEN_FIXARRAY.pack(n, 0x90 | count)
            blob = b"".join([head_bytes, *payloads, _PADS[size - LEN_BYTES - n]])
            if off + size <= cap:
                data[off : off + size] = blob
            else:
                data[off:] = blob[: cap - off]
                data[: size - (cap - off)] = blob[cap - off :]
        if head - self._published + size >= LARGE_COPY_BYTES:
            fence()  # x86 (this path): only a large copy may have used non-temporal stores
        head += size
        self._head = self._published = head
        words = self._words
        words[_PUBLISHED_NS] = monotonic_ns()
        words[_HEAD] = head
        _FENCE_ACQUIRE()  # x86's full fence (_fence_x86), inlined: head store before the loads
        _FENCE_RELEASE()
        sleeps, tail = words[_SLEEPS], words[_TAIL]
        if tail != self._tail:
            if not self._tail <= tail <= head or tail % SLOT_BYTES:
                raise RingCorrupt(f"ring tail {tail} outside [{self._tail}, {head}] or misaligned")
            self._tail = tail
        if sleeps == self._sleeps_seen or (not sleeps & 1 and self._sleeps_seen is not None):
            return 0
        self._sleeps_seen = sleeps
        return 1

    def publish_one(self, payload: bytes) -> int:
        """`publish_array([payload], len(payload))`: a step's only event, the daemon's per-token
        publish (outbox.py `Outbox.publish_alone`). Through the compiled `_ringfast` where it
        was built (`COMPILED_PUBLISH`): the same bytes, accesses, order and validation in one C
        call, with C11 fences in place of the lock round trips (development machine: 0.82 µs
        a call against 1.6-1.7 in Python). Same answers as publish_array, which hands its
        one-event calls (a flush of one stream's event) here when the build exists."""
        if _publish_one_c is None:
            return self.publish_array([payload], len(payload))
        code, head, tail, seen = _publish_one_c(
            self._data, self._words, payload, self._head, self._published, self._tail,
            self._sleeps_seen, self.max_payload_bytes,
        )  # fmt: skip
        if code >= 0:
            self._head = self._published = head
            self._tail, self._sleeps_seen = tail, seen
            return int(code)
        if code == NOT_WRITTEN:
            self._tail = tail
            return NOT_WRITTEN
        self._head = self._published = head  # published before the impossible tail was seen
        raise RingCorrupt(f"ring tail {tail} outside [{self._tail}, {head}] or misaligned")

    def _write(self, blob: bytes, used: int) -> None:
        cap = self.capacity
        off = self._head % cap
        if off + used <= cap:
            self._data[off : off + used] = blob
        else:
            self._data[off:] = blob[: cap - off]
            self._data[: used - (cap - off)] = blob[cap - off :]
        self._head += used

    def try_push(self, payload: bytes | memoryview) -> bool:
        """Append one record unpublished; False (and nothing written) when it does not fit."""
        return self.push_batch((payload,)) == 1

    def push_batch(self, payloads: Iterable[bytes | memoryview]) -> int:
        """Append the longest prefix of `payloads` that fits, unpublished, with one copy into
        the ring; returns how many records were written. The tail is re-read (once) only when
        the known free space runs out."""
        free = self.capacity - (self._head - self._tail)
        refreshed = False
        parts: list[bytes | memoryview] = []
        add = parts.append
        used = count = 0
        limit = self.max_payload_bytes
        pack, pads = _U32.pack, _PADS
        for payload in payloads:
            n = len(payload)
            if n > limit:
                if count:
                    break  # write the records before it; the caller sees it at the front next
                raise ValueError(f"record of {n} bytes exceeds {limit}")
            size = (LEN_BYTES + n + SLOT_BYTES - 1) & -SLOT_BYTES  # whole slots
            if used + size > free:
                if refreshed:
                    break
                self.refresh_tail()
                refreshed, free = True, self.free_bytes()
                if used + size > free:
                    break
            add(pack(n))
            add(payload)
            add(pads[size - LEN_BYTES - n])
            used += size
            count += 1
        if count:
            self._write(b"".join(parts), used)  # one copy into the ring (two across its end)
        return count

    def publish(self) -> int:
        """Make every pushed record visible; returns the published head."""
        if self._head != self._published:
            if WEAK_ORDER or self._head - self._published >= LARGE_COPY_BYTES:
                fence()  # record bytes before the head store
            self._words[_PUBLISHED_NS] = monotonic_ns()
            self._words[_HEAD] = self._head
            self._published = self._head
        return self._published

    def reader_slept(self) -> bool:
        """True when the consumer declared a sleep (odd word) since the last True and has not
        woken to poll since (even word): ring its doorbell now.
        Call after `publish()`. Also re-reads (and validates) the tail, so a hostile tail is
        caught at the next flush rather than only when the ring fills."""
        fence()  # the head store before the sleeps load (Dekker; see the module docstring)
        sleeps = self._words[_SLEEPS]
        self.refresh_tail()
        if sleeps == self._sleeps_seen or (not sleeps & 1 and self._sleeps_seen is not None):
            return False
        self._sleeps_seen = sleeps
        return True

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
        self._sleeps = 0

    @property
    def tail(self) -> int:
        return self._tail

    def published_at(self) -> float:
        """The producer's CLOCK_MONOTONIC time of its latest publish, in seconds (a timing hint
        only: whatever the peer wrote there can cost at most a mistimed poll window)."""
        return self._words[_PUBLISHED_NS] / 1e9

    def pending(self) -> bool:
        """A cheap poll for spinning (no barrier): has the head moved past our tail?"""
        return bool(self._words[_HEAD] != self._tail)

    def drain(self, max_records: int | None = None) -> list[memoryview]:
        """Take every published record (at most `max_records`), as slices of one private copy."""
        tail = self._tail
        head = self._words[_HEAD]
        if head == tail:  # nothing published (no record is read, so no barrier)
            return []
        if WEAK_ORDER:
            fence()  # the head load before the record reads
        cap = self.capacity
        if not tail < head <= tail + cap or head % SLOT_BYTES:
            raise RingCorrupt(f"ring head {head} outside [{tail}, {tail + cap}] or misaligned")
        avail = head - tail
        off = tail % cap
        if off + avail <= cap:
            blob = self._data[off : off + avail].tobytes()
        else:
            blob = self._data[off:].tobytes() + self._data[: avail - (cap - off)].tobytes()
        view = memoryview(blob)
        limit = self.max_payload_bytes
        n = _U32.unpack_from(blob)[0]  # avail >= one slot: a header is there
        if n <= limit and (LEN_BYTES + n + SLOT_BYTES - 1) & -SLOT_BYTES == avail:
            out = [view[LEN_BYTES : LEN_BYTES + n]]  # one record: a reader that keeps up
            pos = avail
        else:
            out, pos = self._split(blob, view, avail, max_records)
        self._tail += pos
        if WEAK_ORDER:
            fence()  # record reads complete before the producer may reuse the space
        self._words[_TAIL] = self._tail
        return out

    def _split(
        self, blob: bytes, view: memoryview, avail: int, max_records: int | None
    ) -> tuple[list[memoryview], int]:
        """drain()'s records of one private copy; returns them and the bytes they span."""
        out: list[memoryview] = []
        pos = 0
        limit = self.max_payload_bytes
        unpack = _U32.unpack_from
        while pos < avail:
            if avail - pos < LEN_BYTES:
                raise RingCorrupt(f"{avail - pos} published bytes cannot hold a record header")
            n = unpack(blob, pos)[0]
            size = (LEN_BYTES + n + SLOT_BYTES - 1) & -SLOT_BYTES
            if n > limit or size > avail - pos:
                raise RingCorrupt(
                    f"record length {n} exceeds the {avail - pos} published bytes or limit"
                )
            out.append(view[pos + LEN_BYTES : pos + LEN_BYTES + n])
            pos += size
            if max_records is not None and len(out) >= max_records:
                break
        return out, pos

    def pop(self) -> bytes | None:
        """Take the next published record, or None when the ring is empty."""
        got = self.drain(max_records=1)
        return got[0].tobytes() if got else None

    def prepare_sleep(self) -> bool:
        """Declare that this side is about to wait for a doorbell. Returns True when the ring
        is still empty after the declaration (sleep now), False when records arrived in the
        meantime (drain them; a doorbell may still come and is harmless)."""
        self._sleeps += 1 + (self._sleeps & 1)  # the next odd value: a new declaration
        self._words[_SLEEPS] = self._sleeps & 0xFFFF_FFFF_FFFF_FFFF
        fence()  # the sleeps store before the head load (Dekker; see the module docstring)
        head = self._words[_HEAD]  # no record is read here, so no barrier after this load
        if not self._tail <= head <= self._tail + self.capacity or head % SLOT_BYTES:
            raise RingCorrupt(f"ring head {head} outside [{self._tail}, +{self.capacity}]")
        return bool(head == self._tail)

    def wake(self) -> None:
        """Withdraw a sleep declaration before polling for expected records: the producer then
        publishes without ringing. No barrier: a producer that still sees the old odd value
        only rings a doorbell the poller does not need."""
        if self._sleeps & 1:
            self._sleeps += 1
            self._words[_SLEEPS] = self._sleeps & 0xFFFF_FFFF_FFFF_FFFF

    @property
    def asleep(self) -> bool:
        """Whether this side's last word to the producer was a sleep declaration."""
        return bool(self._sleeps & 1)
