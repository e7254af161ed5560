"""One client connection after its handshake: frame reading, dispatch, event delivery.

Delivery ("ring" transport): encoded events go through the session's Outbox into its event ring,
one copy and one head store per flush; a doorbell goes out only when the client declared in the
ring that it is going to sleep since the last doorbell (coalesced wake-ups, see
shm_protocol/ring.py): a byte on the session's doorbell pipe (shm_protocol/doorbell.py), or an
EventsReady frame for a client that did not ask for the pipe. A full ring is announced with
EventsReady(writer_blocked) on the socket, once per head, so that the client answers with
Advance. ("socket" transport): the same encoded events go out as frames, one write per
flush. Either way the amount waiting for a slow client is bounded, and the service cancels its
requests after the stall timeout; nothing here ever waits on the client.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from shm_protocol import messages as m
from shm_protocol.codec import HEADER, FrameBuffer, ProtocolViolation, client_decoder, encode_frame
from shm_protocol.doorbell import DoorbellPipe
from shm_protocol.outbox import Outbox, OutboxFull
from shm_protocol.ring import NOT_WRITTEN, RingCorrupt, RingReader, RingWriter
from shm_protocol.segment import Segment

if TYPE_CHECKING:
    from flared.server.service import Service

log = logging.getLogger("flared.server")
READ_BYTES = 1 << 16


class Session:
    def __init__(
        self,
        service: Service,
        session_id: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        transport: str,
        segments: list[Segment],
        peer: tuple[int, int, int],
        bell: DoorbellPipe | None = None,
    ) -> None:
        self.service = service
        self.session_id = session_id
        self.peer = peer
        self.transport = transport
        self.requests: set[str] = set()
        self.closed = False
        self._reader = reader
        self._writer = writer
        self._segments = segments
        self._bell = bell
        self._frames = FrameBuffer(client_decoder(), service.config.max_frame_bytes)
        self.outbox: Outbox | None = None
        self._prompts: RingReader | None = None
        if segments:
            events, prompts = segments
            self.outbox = Outbox(
                RingWriter(events.view, events.capacity), service.config.max_backlog_records
            )
            self._prompts = RingReader(prompts.view, prompts.capacity)
        self._doorbell_head = 0  # the head the last doorbell announced
        self._doorbell_blocked = False
        self._socket_frames: list[bytes] = []  # socket transport: this flush's event frames
        self._socket_stalled_since: float | None = None
        self.overflowed = False  # the backlog limit was hit; the service cancels the requests

    # -- reading ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            while not self.closed:
                data = await self._reader.read(READ_BYTES)
                if not data:
                    break
                for msg in self._frames.feed(data):
                    self._dispatch(msg)
        except ProtocolViolation as exc:
            self.service.counters["protocol_errors_total"] += 1
            log.warning("session %s: protocol violation: %s", self.session_id, exc)
            self.send(m.ErrorReply(m.PROTOCOL, str(exc)))
        except (ConnectionError, OSError):
            pass
        finally:
            await self.close()

    def _dispatch(self, msg: m.ClientMessage) -> None:
        svc = self.service
        if isinstance(msg, m.Submit):
            svc.submit(self, msg)
        elif isinstance(msg, m.Cancel):
            svc.cancel(self, msg.request_id)
        elif isinstance(msg, m.GetStats):
            self.send(m.StatsReply(msg.call_id, svc.health, svc.stats()))
        elif isinstance(msg, m.Ping):
            self.send(m.Pong(msg.call_id, svc.health))
        elif isinstance(msg, m.Render):
            svc.render(self, msg)
        elif isinstance(msg, m.Advance):
            self.flush()
        else:
            raise ProtocolViolation(f"{type(msg).__name__} is only valid as the first frame")

    def read_prompt(self, nbytes: int) -> list[int]:
        """The next request-ring record, which must be exactly `nbytes` of u32 token ids."""
        if self._prompts is None:
            raise ProtocolViolation("prompt_ring_bytes on a session without rings")
        record = self._prompts.pop()
        if record is None:
            raise RingCorrupt("Submit names a prompt record but the request ring is empty")
        if len(record) != nbytes or nbytes % 4:
            raise RingCorrupt(f"prompt record is {len(record)} bytes, Submit said {nbytes}")
        ids = array.array("I")
        ids.frombytes(record)
        if sys.byteorder != "little":
            ids.byteswap()
        return ids.tolist()

    # -- writing ---------------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        """A control frame on the socket (replies, errors, doorbells)."""
        if not self.closed:
            if self._socket_frames:  # keep frame order: queued events go first
                self._write_socket_frames()
            self._writer.write(encode_frame(msg))

    def enqueue(self, request_id: str, payload: bytes, terminal: bool) -> None:
        if self.closed:
            return
        if self.outbox is None:
            self._socket_frames += (HEADER.pack(len(payload)), payload)
            return
        try:
            self.outbox.enqueue(request_id, payload, terminal)
        except OutboxFull:
            self.overflowed = True

    def _write_socket_frames(self) -> None:
        self._writer.write(b"".join(self._socket_frames))
        self._socket_frames.clear()

    def publish_one(self, request_id: str, payload: bytes, terminal: bool) -> None:
        """`enqueue` + `flush` for a step's only event: one ring call when nothing waits."""
        outbox = self.outbox
        if outbox is not None and not self.closed:
            try:
                wake = outbox.publish_alone(payload)
            except RingCorrupt as exc:
                self._ring_corrupt(exc)
                return
            if wake != NOT_WRITTEN:
                self._signal(outbox.writer.head, False, wake == 1)
                return
        self.enqueue(request_id, payload, terminal)
        self.flush()

    def flush(self) -> None:
        """Publish what fits in the ring, ringing the doorbell only if the client sleeps."""
        if self.closed:
            return
        if self.outbox is None:
            if self._socket_frames:
                self._write_socket_frames()  # one write per flush, as the ring has one publish
            return
        try:
            # one call publishes and reads the sleep word: a sleeping client is woken once per
            # published head; an awake one finds the records itself
            head, blocked, wake = self.outbox.flush_check()
        except RingCorrupt as exc:
            self._ring_corrupt(exc)
            return
        self._signal(head, blocked, wake)

    def _ring_corrupt(self, exc: RingCorrupt) -> None:
        """The client wrote an impossible tail into the mapping: end the session."""
        self.service.counters["protocol_errors_total"] += 1
        log.warning("session %s: %s", self.session_id, exc)
        self.send(m.ErrorReply(m.PROTOCOL, str(exc)))
        self.abort()

    def _signal(self, head: int, blocked: bool, wake: bool) -> None:
        """After a publish: the doorbell for a sleeping reader, a full ring's announcement."""
        # a full ring is announced once per head so the client answers with one Advance (the
        # monitor's periodic retry needs no doorbell)
        announce = blocked and (not self._doorbell_blocked or head != self._doorbell_head)
        if wake and self._bell is not None:
            self._doorbell_head = head
            self._bell.ring()  # never blocks; a vanished reader shows up as socket EOF
            wake = False
        if wake or announce:
            self._doorbell_head, self._doorbell_blocked = head, blocked
            self.send(m.EventsReady(head, blocked))
        elif not blocked:
            self._doorbell_blocked = False

    def stalled_for(self, now: float) -> float:
        """How long this client has not been taking its events."""
        if self.outbox is not None:
            return self.outbox.stalled_for(now)
        size = self._writer.transport.get_write_buffer_size()
        if size <= self.service.config.max_socket_buffer_bytes:
            self._socket_stalled_since = None
            return 0.0
        if self._socket_stalled_since is None:
            self._socket_stalled_since = now
        return now - self._socket_stalled_since

    def drop(self, request_id: str) -> None:
        if self.outbox is not None:
            self.outbox.drop(request_id)

    # -- teardown --------------------------------------------------------------------------
    def abort(self) -> None:
        """Close now; run()'s finally does the bookkeeping."""
        if not self.closed:
            self._writer.transport.abort() if self._writer.transport else None
            self._reader.feed_eof()

    async def close(self, drain_s: float = 0.0) -> None:
        if self.closed:
            return
        if drain_s > 0:
            self.flush()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writer.drain(), drain_s)
        self.closed = True
        self.service.session_closed(self)
        with contextlib.suppress(Exception):
            self._writer.close()
        if self.outbox is not None:
            self.outbox.writer.release()
        if self._prompts is not None:
            self._prompts.release()
        for seg in self._segments:
            seg.close()
        self._segments = []
        if self._bell is not None:
            self._bell.close()

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "pid": self.peer[0],
            "uid": self.peer[1],
            "transport": self.transport,
            "requests": len(self.requests),
            "backlog_records": self.outbox.backlog_records if self.outbox else 0,
            "stalled_s": round(self.stalled_for(time.monotonic()), 3),
        }
