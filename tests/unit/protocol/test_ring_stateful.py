"""The ring (plus the daemon's per-session outbox in front of it) against a deque model.

Payload sizes cover the slot boundaries (0, 1, slot-1, slot, slot+1, the record header's edges)
and larger records up to the whole ring, so wrap-around and a full ring happen constantly.
Cancels drop a request's not-yet-written, non-terminal records from the outbox, as the daemon
does when a request is cancelled. The doorbell protocol is modelled too: the reader declares
its sleeps, the writer rings only after a declaration, and a sleeping reader with published
records always gets its doorbell (no lost wake-up).
"""

from __future__ import annotations

from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shm_protocol.outbox import Outbox
from shm_protocol.ring import (
    LEN_BYTES,
    NOT_WRITTEN,
    SLOT_BYTES,
    RingReader,
    RingWriter,
    init_header,
    record_bytes,
)

CAPACITY = 8 * SLOT_BYTES
SIZES = [
    0,
    1,
    SLOT_BYTES - LEN_BYTES - 1,
    SLOT_BYTES - LEN_BYTES,
    SLOT_BYTES - LEN_BYTES + 1,
    SLOT_BYTES - 1,
    SLOT_BYTES,
    SLOT_BYTES + 1,
    3 * SLOT_BYTES + 7,
    CAPACITY // 2,
    CAPACITY - LEN_BYTES,  # the largest record: exactly the whole ring
]
REQUESTS = ["a", "b", "c"]


class RingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf = memoryview(bytearray(CAPACITY + 192))
        init_header(self.buf, CAPACITY)
        self.writer = RingWriter(self.buf, CAPACITY)
        self.reader = RingReader(self.buf, CAPACITY)
        self.outbox = Outbox(self.writer, max_backlog_records=64, batch=False)
        self.in_ring: deque[bytes] = deque()  # model: published, not yet read
        self.backlog: deque[tuple[str, bytes, bool]] = deque()  # model: waiting for space
        self.counter = 0
        self.sleeps = 0  # model: the reader's sleep declarations
        self.sleeps_seen: int | None = None  # model: the last one the writer answered
        self.asleep = False  # model: the reader declared a sleep and found the ring empty

    def _payload(self, size: int) -> bytes:
        self.counter += 1
        return bytes((self.counter + i) % 251 for i in range(size))

    @rule(size=st.sampled_from(SIZES), rid=st.sampled_from(REQUESTS), terminal=st.booleans())
    def enqueue(self, size: int, rid: str, terminal: bool) -> None:
        if len(self.backlog) >= 64:
            return
        payload = self._payload(size)
        self.outbox.enqueue(rid, payload, terminal)
        self.backlog.append((rid, payload, terminal))

    @rule()
    def flush(self) -> None:
        self.outbox.flush()
        # model: move from the backlog while the next record fits in the free space
        used = sum(record_bytes(len(p)) for p in self.in_ring)
        while self.backlog and used + record_bytes(len(self.backlog[0][1])) <= CAPACITY:
            _rid, payload, _t = self.backlog.popleft()
            self.in_ring.append(payload)
            used += record_bytes(len(payload))

    @rule(n=st.integers(1, 4))
    def read_some(self, n: int) -> None:
        got = self.reader.drain(max_records=n)
        expected = [self.in_ring.popleft() for _ in range(min(n, len(self.in_ring)))]
        assert [bytes(g) for g in got] == expected
        self.asleep = False

    @rule()
    def read_all(self) -> None:
        got = self.reader.drain()
        assert [bytes(g) for g in got] == list(self.in_ring)
        self.in_ring.clear()
        self.asleep = False

    @rule()
    def read_one(self) -> None:
        got = self.reader.pop()
        assert got == (self.in_ring.popleft() if self.in_ring else None)
        self.asleep = False

    @rule()
    def reader_declares_sleep(self) -> None:
        empty = self.reader.prepare_sleep()
        self.sleeps += 1
        assert empty == (not self.in_ring)
        self.asleep = empty

    @rule()
    def flush_and_ring(self) -> None:
        """What the daemon does per flush: publish, then ring if the reader declared a sleep."""
        self.flush()
        wake = self.writer.reader_slept()
        assert wake == (self.sleeps != self.sleeps_seen)
        self.sleeps_seen = self.sleeps
        if self.asleep and self.in_ring:  # no lost wake-up
            assert wake
        if wake:
            self.asleep = False  # the doorbell wakes it

    @precondition(lambda self: not self.backlog)
    @rule(size=st.sampled_from(SIZES))
    def publish_one(self, size: int) -> None:
        """The daemon's per-token publish (compiled where built): one event as an array of one,
        published and answered with the doorbell decision, or not written when it does not fit."""
        payload = self._payload(size)
        used = sum(record_bytes(len(p)) for p in self.in_ring)
        fits = (
            1 + size <= self.writer.max_payload_bytes and used + record_bytes(1 + size) <= CAPACITY
        )
        wake = self.writer.publish_one(payload)
        if not fits:
            assert wake == NOT_WRITTEN
            return
        self.in_ring.append(b"\x91" + payload)
        assert wake == (self.sleeps != self.sleeps_seen)
        self.sleeps_seen = self.sleeps
        if wake:
            self.asleep = False

    @rule(rid=st.sampled_from(REQUESTS))
    def cancel(self, rid: str) -> None:
        self.outbox.drop(rid)
        self.backlog = deque(e for e in self.backlog if e[0] != rid or e[2])

    @precondition(lambda self: True)
    @rule(size=st.sampled_from(SIZES))
    def rollback_unpublished(self, size: int) -> None:
        # a record pushed but not published is invisible and can be taken back
        self.outbox.flush()
        self.flush_model_only()
        if self.writer.try_push(self._payload(size)):
            self.writer.rollback()
        assert self.reader.pop() == (self.in_ring.popleft() if self.in_ring else None)

    def flush_model_only(self) -> None:
        used = sum(record_bytes(len(p)) for p in self.in_ring)
        while self.backlog and used + record_bytes(len(self.backlog[0][1])) <= CAPACITY:
            self.in_ring.append(self.backlog.popleft()[1])
            used += record_bytes(len(self.in_ring[-1]))

    @invariant()
    def accounting(self) -> None:
        used = sum(record_bytes(len(p)) for p in self.in_ring)
        assert self.writer.head - self.reader.tail == used <= CAPACITY
        assert self.outbox.backlog_records == len(self.backlog)
        assert self.writer.head % SLOT_BYTES == 0


TestRing = RingMachine.TestCase
TestRing.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
