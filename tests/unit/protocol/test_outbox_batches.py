"""The event ring's batch records (Outbox(batch=True)) against a FIFO model.

Each flush turns what fits of the backlog into ONE ring record, a msgpack array of the queued
payloads. Whatever the interleaving of enqueues, flushes, one-event publishes, reads, cancels and
sleep declarations: the reader decodes exactly the payloads in enqueue order (minus cancelled
non-terminal ones still waiting), the ring never holds more than its capacity, a flush into an
empty ring always moves something, and a sleeping reader with published records always gets its
doorbell.
"""

from __future__ import annotations

from collections import deque

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from shm_protocol import ring
from shm_protocol.codec import ARRAY_HEADER_MAX_BYTES
from shm_protocol.outbox import Outbox
from shm_protocol.ring import LEN_BYTES, SLOT_BYTES, RingReader, RingWriter, init_header

CAPACITY = 8 * SLOT_BYTES
BIN_HEADER = 3  # msgpack bin16 for the larger payloads (bin8: 2)
LARGEST = CAPACITY - LEN_BYTES - ARRAY_HEADER_MAX_BYTES - BIN_HEADER  # one event fills the ring
SIZES = [0, 1, SLOT_BYTES - 8, SLOT_BYTES, SLOT_BYTES + 1, 3 * SLOT_BYTES + 7, 250, LARGEST]
REQUESTS = ["a", "b", "c"]


class BatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.buf = memoryview(bytearray(CAPACITY + 192))
        init_header(self.buf, CAPACITY)
        self.writer = RingWriter(self.buf, CAPACITY)
        self.reader = RingReader(self.buf, CAPACITY)
        self.outbox = Outbox(self.writer, max_backlog_records=64)
        self.backlog: deque[tuple[str, bytes, bool]] = deque()  # model: waiting for space
        self.in_ring: deque[bytes] = deque()  # model: published, not yet read, in order
        self.counter = 0
        self.asleep = False

    def _payload(self, size: int) -> bytes:
        self.counter += 1
        return msgspec.msgpack.encode(bytes((self.counter + i) % 251 for i in range(size)))

    @rule(size=st.sampled_from(SIZES), rid=st.sampled_from(REQUESTS), terminal=st.booleans())
    def enqueue(self, size: int, rid: str, terminal: bool) -> None:
        if len(self.backlog) >= 64:
            return
        payload = self._payload(size)
        self.outbox.enqueue(rid, payload, terminal)
        self.backlog.append((rid, payload, terminal))

    @rule()
    def flush(self) -> None:
        ring_was_empty = self.writer.head == self.reader.tail
        waiting = len(self.backlog)
        self.outbox.flush()
        moved = waiting - self.outbox.backlog_records
        for _ in range(moved):
            self.in_ring.append(self.backlog.popleft()[1])
        if ring_was_empty and waiting:
            assert moved >= 1  # every event fits an empty ring
        if moved:  # the daemon asks only when the head moved (Session.flush)
            wake = self.writer.reader_slept()
            assert wake or not self.asleep  # no lost wake-up
            self.asleep = False

    @rule()
    def flush_check(self) -> None:
        """The daemon's one-call flush (Outbox.flush_check -> RingWriter.publish_array)."""
        ring_was_empty = self.writer.head == self.reader.tail
        waiting = len(self.backlog)
        head_before = self.writer.head
        head, blocked, wake = self.outbox.flush_check()
        moved = waiting - self.outbox.backlog_records
        for _ in range(moved):
            self.in_ring.append(self.backlog.popleft()[1])
        assert head == self.writer.head and blocked == bool(self.backlog)
        if ring_was_empty and waiting:
            assert moved >= 1
        if moved:
            assert wake or not self.asleep  # no lost wake-up
            self.asleep = False
        else:
            assert head == head_before and not wake  # nothing published: nothing to ring

    @rule(size=st.sampled_from(SIZES), rid=st.sampled_from(REQUESTS), terminal=st.booleans())
    def publish_one(self, size: int, rid: str, terminal: bool) -> None:
        """A step's only event (Session.publish_one): published alone when nothing waits and it
        fits, else enqueued and flushed, so it never overtakes a waiting record."""
        payload = self._payload(size)
        waiting = bool(self.backlog)
        ring_was_empty = self.writer.head == self.reader.tail
        wake = self.outbox.publish_alone(payload)
        assert wake != ring.NOT_WRITTEN or waiting or not ring_was_empty  # an empty ring takes it
        if wake != ring.NOT_WRITTEN:
            assert not waiting
            self.in_ring.append(payload)
            assert wake or not self.asleep  # no lost wake-up
            self.asleep = False
        elif len(self.backlog) < 64:
            self.outbox.enqueue(rid, payload, terminal)
            self.backlog.append((rid, payload, terminal))
            self.flush_check()

    @rule()
    def read_all(self) -> None:
        records = self.reader.drain()
        got = [msgspec.msgpack.encode(x) for r in records for x in msgspec.msgpack.decode(r)]
        assert got == list(self.in_ring)
        self.in_ring.clear()
        self.asleep = False

    @rule()
    def read_one_record(self) -> None:
        records = self.reader.drain(max_records=1)
        got = [msgspec.msgpack.encode(x) for r in records for x in msgspec.msgpack.decode(r)]
        assert got == [self.in_ring.popleft() for _ in range(len(got))]
        self.asleep = False

    @rule()
    def reader_declares_sleep(self) -> None:
        empty = self.reader.prepare_sleep()
        assert empty == (not self.in_ring)
        self.asleep = empty

    @rule(rid=st.sampled_from(REQUESTS))
    def cancel(self, rid: str) -> None:
        self.outbox.drop(rid)
        self.backlog = deque(e for e in self.backlog if e[0] != rid or e[2])

    @invariant()
    def accounting(self) -> None:
        assert 0 <= self.writer.head - self.reader.tail <= CAPACITY
        assert self.writer.head % SLOT_BYTES == 0
        assert self.outbox.backlog_records == len(self.backlog)
        assert self.outbox.backlog_bytes == sum(len(e[1]) for e in self.backlog)


TestBatches = BatchMachine.TestCase
TestBatches.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class WeakOrderBatchMachine(BatchMachine):
    """The same machine where flush_check takes the fenced path of weakly ordered CPUs."""

    def __init__(self) -> None:
        super().__init__()
        ring.WEAK_ORDER = True

    def teardown(self) -> None:
        ring.WEAK_ORDER = WEAK_ORDER_HOST


WEAK_ORDER_HOST = ring.WEAK_ORDER
TestWeakOrderBatches = WeakOrderBatchMachine.TestCase
TestWeakOrderBatches.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)


def test_publish_alone_writes_nothing_unless_it_can_be_the_next_record() -> None:
    """Records waiting (it would overtake them) or unbatched records (one record per payload,
    the daemon's other rings): NOT_WRITTEN and the ring untouched; else one published record."""
    buf = memoryview(bytearray(CAPACITY + 192))
    init_header(buf, CAPACITY)
    writer, reader = RingWriter(buf, CAPACITY), RingReader(buf, CAPACITY)
    unbatched = Outbox(writer, batch=False)
    assert unbatched.publish_alone(b"\x01") == ring.NOT_WRITTEN and writer.head == 0
    outbox = Outbox(writer)
    outbox.enqueue("a", b"\x02", False)
    assert outbox.publish_alone(b"\x03") == ring.NOT_WRITTEN and writer.head == 0
    outbox.flush_check()
    assert outbox.publish_alone(b"\x04") == 0  # the first publish rang; the reader is awake
    assert [msgspec.msgpack.decode(r) for r in reader.drain()] == [[2], [4]]
