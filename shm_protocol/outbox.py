"""The producer's per-session queue in front of an event ring (pure; no I/O).

Records wait in FIFO order in a bounded backlog until the ring has room; `flush()` moves as many
as fit, in order, with one copy into the ring, and publishes them with one head store (the
caller then rings at most one doorbell for the whole batch, and only if the reader declared it
is asleep). With `batch` (the event ring's format), what one flush moves becomes ONE ring
record: a msgpack array whose elements are the queued payloads (each an encoded message), so
the reader takes and decodes a whole step's events with one call each instead of one per
event; without it each payload is its own record. A full ring means the client stopped
reading: the backlog absorbs a bounded burst, and the caller watches `blocked_since` to cancel the session's requests after its stall
timeout. `drop(request_id)` discards a cancelled request's waiting token records but keeps its
terminal record, so the client still learns how the request ended.
"""

from __future__ import annotations

import time
from collections import deque

from shm_protocol.codec import ARRAY_HEADER_MAX_BYTES
from shm_protocol.ring import NOT_WRITTEN, RingWriter


class OutboxFull(Exception):
    """The backlog limit was reached; the consumer is not keeping up."""


# backlog entry: (request_id, payload, terminal); plain tuples keep enqueue cheap per token
_Entry = tuple[str, bytes, bool]


class Outbox:
    def __init__(
        self, writer: RingWriter, max_backlog_records: int = 4096, *, batch: bool = True
    ) -> None:
        self.writer = writer
        self.batch = batch
        self.max_backlog_records = max_backlog_records
        self._backlog: deque[_Entry] = deque()
        self._payloads: list[bytes] = []  # the backlog's payloads, in order (flush's fast path)
        self._backlog_bytes = 0
        self.blocked_since: float | None = None  # monotonic time the ring first had no room

    @property
    def backlog_records(self) -> int:
        return len(self._backlog)

    @property
    def backlog_bytes(self) -> int:
        return self._backlog_bytes

    def enqueue(self, request_id: str, payload: bytes, terminal: bool) -> None:
        payloads = self._payloads
        if len(payloads) >= self.max_backlog_records:
            raise OutboxFull(f"{len(payloads)} event records are waiting for the client")
        payloads.append(payload)
        self._backlog.append((request_id, payload, terminal))
        self._backlog_bytes += len(payload)

    def flush(self) -> tuple[int, bool]:
        """Write what fits, publish. Returns (published head, blocked: records still waiting)."""
        backlog = self._backlog
        if backlog and self.batch:
            if self.writer.push_array(self._payloads, self._backlog_bytes, True):
                backlog.clear()  # the common case: one record holds everything, published
                self._payloads.clear()
                self._backlog_bytes = 0
                self.blocked_since = None
                return self.writer.head, False
            self._push_prefix()
        elif backlog:
            written = self.writer.push_batch(self._payloads)
            if written == len(backlog):  # the common case: everything fit
                backlog.clear()
                self._payloads.clear()
                self._backlog_bytes = 0
            else:
                self._pop(written)
        head = self.writer.publish()
        blocked = bool(backlog)
        if blocked and self.blocked_since is None:
            self.blocked_since = time.monotonic()
        elif not blocked:
            self.blocked_since = None
        return head, blocked

    def flush_check(self) -> tuple[int, bool, bool]:
        """`flush()`, then whether to ring the reader's doorbell (`RingWriter.reader_slept`),
        checked only when this flush published something: (published head, blocked, wake).
        The common case (the whole backlog fits as one record) is one writer call."""
        payloads = self._payloads
        if payloads and self.batch:
            writer = self.writer
            wake = writer.publish_array(payloads, self._backlog_bytes)
            if wake != NOT_WRITTEN:
                self._backlog.clear()
                payloads.clear()
                self._backlog_bytes = 0
                self.blocked_since = None
                return writer.head, False, wake == 1
        before = self.writer.head
        head, blocked = self.flush()
        return head, blocked, head != before and self.writer.reader_slept()

    def publish_alone(self, payload: bytes) -> int:
        """A step's only event, published as its own record when nothing waits before it: one
        writer call, no backlog bookkeeping (a one-stream step: enqueue + `flush_check` cost
        ~0.5 µs more). Returns `RingWriter.publish_array`'s answer: 0 or 1 (published; 1 =
        ring the doorbell) or NOT_WRITTEN, when records wait, the ring has no room or records
        are not batched: nothing was written, so enqueue it and flush instead."""
        if self._payloads or not self.batch:
            return NOT_WRITTEN
        wake = self.writer.publish_one(payload)
        if wake != NOT_WRITTEN:
            self.blocked_since = None
        return wake

    def _push_prefix(self) -> None:
        """When the whole backlog does not fit: move its longest prefix that does, as one array
        record (unpublished; flush() publishes)."""
        backlog, writer = self._backlog, self.writer
        room = writer.room(ARRAY_HEADER_MAX_BYTES + self._backlog_bytes) - ARRAY_HEADER_MAX_BYTES
        take = used = 0
        for e in backlog:
            if used + len(e[1]) > room:
                break
            used += len(e[1])
            take += 1
        if not take:
            first = len(backlog[0][1]) + ARRAY_HEADER_MAX_BYTES
            if first > writer.max_payload_bytes:
                raise ValueError(f"record of {first} bytes exceeds {writer.max_payload_bytes}")
            return  # blocked until the reader frees space
        if writer.push_array(self._payloads[:take], used):
            self._pop(take)

    def _pop(self, count: int) -> None:
        """Forget the first `count` backlog entries (written into the ring)."""
        backlog = self._backlog
        for _ in range(count):
            self._backlog_bytes -= len(backlog.popleft()[1])
        del self._payloads[:count]

    def drop(self, request_id: str) -> int:
        """Discard waiting non-terminal records of `request_id`; returns how many."""
        kept = deque(e for e in self._backlog if e[0] != request_id or e[2])
        dropped = len(self._backlog) - len(kept)
        self._backlog = kept
        self._payloads = [e[1] for e in kept]
        self._backlog_bytes = sum(map(len, self._payloads))
        return dropped

    def stalled_for(self, now: float | None = None) -> float:
        if self.blocked_since is None:
            return 0.0
        return (time.monotonic() if now is None else now) - self.blocked_since
