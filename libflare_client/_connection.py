"""One live session with the daemon, on one asyncio loop.

Owns the socket streams, the two rings (events in, prompts out), and the routing of incoming
messages to per-request queues and per-call futures. When the connection dies every waiter gets
ConnectionLost; nothing is ever resubmitted. A watchdog pings an idle-looking daemon while
requests are outstanding, so a hung daemon is detected within `liveness_timeout_s`.

Event ring: a doorbell makes the client drain every record, decode each from a zero-copy slice,
and declare in the ring that it is going to sleep before it returns to the loop; the daemon
rings again only after such a declaration. The doorbell is a byte on the session's pipe, whose
read end the loop polls directly (`_on_doorbell`: the records are taken first, the byte after),
or an EventsReady frame from a daemon that offers no pipe. The watchdog's tick is the timeout of
that wait: it re-checks the ring, so even a lost doorbell costs at most one tick. Each ring
record is one flush's events as a msgpack array, decoded in one call.

Anticipation (`anticipate_events`; by default on where timerfd exists and the process may run
on at least `ANTICIPATE_MIN_CPUS` CPUs, see `anticipation_default`): while events arrive at a
steady cadence (a decoding stream), a `WakeTimer` wakes the loop just before the next expected
batch; the client withdraws its sleep declaration and polls the ring for at most a short window
(shm_protocol/cadence.py), so the batch is taken the moment it lands, without a doorbell. An
early or late batch still rings the doorbell as usual. A timer readiness that the loop
reports after the timer was re-armed (a doorbell handled in the same loop iteration drained the
batch and armed the next window) is ignored: polling on it would spin, sleep withdrawn, until
the next window's end.

Every ring client lingers in a flood: when its last two batches were published a few
microseconds apart (a fast producer, never a decode cadence), it polls the ring for four such
gaps before declaring its sleep, so the next batch is taken without a doorbell syscall and a
wake-up per batch (`Cadence.linger`; at most `MAX_LINGERS` in a row before the loop's other
callbacks run). It also lingers for the rest of a step that recent steps published in several
parts (a session whose requests the daemon renders on different detokenizer lanes), for at
most their usual spread.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import itertools
import os
import sys
import time
from pathlib import Path
from typing import Any

from libflare_client._handshake import handshake
from libflare_client.errors import ConnectionLost, FlareError, ProtocolError, from_reply
from libflare_client.types import StreamEvent, delta_event, finished_event
from shm_protocol import doorbell
from shm_protocol import messages as m
from shm_protocol.cadence import Cadence, WakeTimer, poll_until, usable_cpus
from shm_protocol.codec import (
    HEADER_BYTES,
    FrameBuffer,
    ProtocolViolation,
    daemon_decoder,
    encode_frame,
    ring_event_decoder,
)
from shm_protocol.ring import RingReader, RingWriter
from shm_protocol.segment import Segment, map_ring_segment

INLINE_PROMPT_TOKENS = 32  # longer prompts travel through the request ring
READ_BYTES = 1 << 16
PING_AFTER_S = 1.0
MAX_LINGERS = 8  # polls for a fast stream's next batch per wake-up: the loop's other tasks wait
# Anticipation polls up to a quarter of each step on the client's CPU: where the process may run
# on fewer CPUs than this, that time would be taken from the daemon beside it, so it is off.
ANTICIPATE_MIN_CPUS = 4


def anticipation_default(requested: bool | None = None) -> bool:
    """Whether a ring session anticipates its events: `requested`; else FLARE_CLIENT_ANTICIPATE
    (1/0) where set; else whether this process may run on at least ANTICIPATE_MIN_CPUS CPUs.
    Measured on the H200 host (16 CPUs): a paced event's delivery latency halves, and through
    the daemon the client spends 60-70 us more CPU per token at 1-4 streams with inter-token
    p50 and p99 unchanged (README, "Anticipation by default")."""
    if requested is not None:
        return requested
    env = os.environ.get("FLARE_CLIENT_ANTICIPATE", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    return usable_cpus() >= ANTICIPATE_MIN_CPUS  # affinity capped by a cgroup CPU quota


QueueItem = StreamEvent | FlareError


class Connection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        welcome: m.Welcome,
        segments: list[Segment],
        liveness_timeout_s: float,
        bell_fd: int = -1,
        anticipate_events: bool | None = None,
    ) -> None:
        self.welcome = welcome
        self._reader = reader
        self._writer = writer
        self._segments = segments
        self._events: RingReader | None = None
        self._prompts: RingWriter | None = None
        if segments:
            self._events = RingReader(segments[0].view, segments[0].capacity)
            self._prompts = RingWriter(segments[1].view, segments[1].capacity)
        self._decoder = daemon_decoder()
        self._ring_decoder = ring_event_decoder()
        self._frames = FrameBuffer(self._decoder, welcome.max_frame_bytes)
        self._streams: dict[str, asyncio.Queue[QueueItem]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._liveness_timeout_s = liveness_timeout_s
        self._loop = asyncio.get_running_loop()
        self._last_rx = self._loop.time()
        self.closed = False
        self._bell_fd = bell_fd
        self._cadence: Cadence | None = None
        self._timer: WakeTimer | None = None
        self._poll_until = 0.0
        self.transport_counters = {"doorbell_wakes": 0, "poll_windows": 0, "polls_caught": 0}
        if self._events is not None:
            self._cadence = Cadence()  # learned by every ring session: it counts late steps
        if bell_fd >= 0:
            self._loop.add_reader(bell_fd, self._on_doorbell)
            if anticipation_default(anticipate_events) and self._events is not None:
                self._timer = WakeTimer.create()
            if self._timer is not None:
                self._loop.add_reader(self._timer.fd, self._on_timer)
        self._tasks = [
            self._loop.create_task(self._read_loop()),
            self._loop.create_task(self._watchdog()),
        ]

    @classmethod
    async def open(
        cls,
        path: Path,
        *,
        transport: str,
        connect_timeout_s: float,
        liveness_timeout_s: float,
        client_name: str,
        anticipate_events: bool | None = None,
    ) -> Connection:
        loop = asyncio.get_running_loop()
        done = loop.run_in_executor(
            None, handshake, path, transport, connect_timeout_s, client_name
        )
        try:
            sock, welcome, fds = await asyncio.shield(done)
        except asyncio.CancelledError:  # the handshake thread goes on: close what it opens
            done.add_done_callback(_close_handshake)
            raise
        segments: list[Segment] = []
        bell_fd = fds[2] if len(fds) > 2 else -1
        try:
            if fds:
                segments.append(map_ring_segment(fds[0], welcome.event_ring_bytes))
                segments.append(map_ring_segment(fds[1], welcome.request_ring_bytes))
            if bell_fd >= 0:
                os.set_blocking(bell_fd, False)  # our end; the daemon's end is its own
            sock.settimeout(None)
            sock.setblocking(False)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except BaseException as exc:
            sock.close()
            for seg in segments:
                seg.close()
            if bell_fd >= 0:
                os.close(bell_fd)
            raise ProtocolError(f"could not map the daemon's rings: {exc}") from exc
        return cls(
            reader, writer, welcome, segments, liveness_timeout_s, bell_fd, anticipate_events
        )

    # -- sending ---------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        self._writer.write(self._frame(msg))

    def _frame(self, msg: Any) -> bytes:
        """`msg` as a frame, or InvalidRequest (nothing sent) when its body is over the
        daemon's frame limit: the daemon would close the whole connection for it, failing
        every other request this client has in flight."""
        frame = encode_frame(msg)
        self._check_size(len(frame) - HEADER_BYTES)
        return frame

    def _check_size(self, body_bytes: int) -> None:
        limit = self.welcome.max_frame_bytes
        if limit and body_bytes > limit:
            from libflare_client.errors import InvalidRequest

            raise InvalidRequest(
                f"the request is {body_bytes} bytes encoded, above the daemon's limit of "
                f"{limit} bytes (max_frame_bytes); long prompts travel best as token ids"
            )

    async def flush(self) -> None:
        """Wait until what was written drained to the socket (ConnectionLost if it failed)."""
        try:
            await self._writer.drain()
        except (OSError, RuntimeError) as exc:
            self._fail(ConnectionLost(f"lost the daemon while sending: {exc}"))
            raise ConnectionLost(f"lost the daemon while sending: {exc}") from None

    @property
    def idle(self) -> bool:
        """No stream and no call in flight on this session."""
        return not self._streams and not self._calls

    def _touch_if_idle(self) -> None:
        if self.idle:
            self._last_rx = self._loop.time()  # idle time is not silence

    def start(self, submit: m.Submit) -> asyncio.Queue[QueueItem]:
        """Register and write a Submit (or raise before anything is sent); events for it arrive
        on the returned queue, ending with a final StreamEvent (finish_reason set) or a
        FlareError. The caller then awaits `flush`: cancelled there, it knows the request
        exists and must cancel it."""
        if self.closed:
            raise ConnectionLost("the connection to the daemon is closed")
        if submit.request_id in self._streams:
            from libflare_client.errors import InvalidRequest

            raise InvalidRequest(f"request id {submit.request_id!r} is already in flight")
        frame = self._ring_or_inline(submit)
        self._touch_if_idle()
        q: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._streams[submit.request_id] = q
        # the ring record (if any) and this frame are written without an await in between, so
        # ring order equals frame order; the frame's send syscall publishes the ring write
        self._writer.write(frame)
        return q

    def _ring_or_inline(self, submit: m.Submit) -> bytes:
        """The Submit's frame, its token ids moved to the prompt ring when they are many and
        fit. The frame that will be sent is size-checked before a ring record is written, so a
        refused request leaves no record that the daemon would pair with a later Submit."""
        ids = submit.prompt_token_ids
        if self._prompts is None or len(ids) <= INLINE_PROMPT_TOKENS:
            return self._frame(submit)
        try:
            packed = array.array("I", ids)
        except (OverflowError, TypeError):
            return self._frame(submit)  # not u32: let the daemon reject it with a typed error
        if sys.byteorder != "little":
            packed.byteswap()
        payload = packed.tobytes()
        if len(payload) <= self._prompts.max_payload_bytes:
            import msgspec

            ringed = msgspec.structs.replace(
                submit, prompt_token_ids=[], prompt_ring_bytes=len(payload)
            )
            frame = self._frame(ringed)  # raises before anything is written
            if self._prompts.try_push(payload):
                self._prompts.publish()
                return frame
        return self._frame(submit)  # ring full or too large: inline (the frame limit applies)

    def forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def cancel(self, request_id: str) -> None:
        self._send(m.Cancel(request_id))
        await self.flush()

    async def call(self, make: Any) -> Any:
        """Send `make(call_id)` and wait for the reply with that call id."""
        cid = next(self._call_ids)
        self._touch_if_idle()
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls[cid] = fut
        try:
            self._send(make(cid))
            await self.flush()
            return await fut
        finally:
            self._calls.pop(cid, None)

    # -- receiving -------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(READ_BYTES)
                if not data:
                    raise ConnectionLost("the daemon closed the connection")
                self._last_rx = self._loop.time()
                for msg in self._frames.feed(data):
                    self._handle(msg)
        except ProtocolViolation as exc:
            self._fail(ProtocolError(f"invalid data from the daemon: {exc}"))
        except FlareError as exc:
            self._fail(exc)
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._fail(ConnectionLost(f"lost the daemon: {exc}"))
        except asyncio.CancelledError:
            self._fail(ConnectionLost("the connection was closed"))

    def _take_events(self) -> int:
        """Decode and route every published event-ring record; returns how many."""
        ring = self._events
        if ring is None:
            raise ProtocolViolation("a doorbell on a socket-transport session")
        records = ring.drain()
        if not records:
            return 0
        self._last_rx = self._loop.time()
        decode = self._ring_decoder.decode
        handle = self._handle
        for record in records:
            for msg in decode(record):  # the decoder admits TokenDelta, Finished, ErrorReply
                handle(msg)
        if self._cadence is not None:  # after the events are out
            self._cadence.observe(ring.published_at())
        return len(records)

    def _drain_events(self) -> None:
        """Take every event-ring record, then declare the sleep that lets the daemon ring the
        next doorbell; records that arrived meanwhile are taken first (no lost wake-up)."""
        ring, cadence = self._events, self._cadence
        lingers = 0
        while True:
            self._take_events()
            if ring is None:
                return
            linger = cadence.linger() if cadence is not None else 0.0
            if linger and poll_until(ring, time.monotonic() + linger):
                lingers += 1  # a fast stream's next batch landed while we polled
                if lingers < MAX_LINGERS:
                    continue
                # let the loop's other tasks (the streams' consumers) run, then go on draining
                # without declaring a sleep (no doorbell for a reader that is busy anyway)
                self._loop.call_soon(self._drain_safely)
                return
            if ring.prepare_sleep():
                break
        if self._timer is not None and cadence is not None:
            window = cadence.window(time.monotonic())
            if window is None:
                self._timer.disarm()
            else:
                self._timer.arm_at(window[0])
                self._poll_until = window[1]

    def transport_stats(self) -> dict[str, int]:
        """The counters plus the steps whose events were published late (see Cadence)."""
        late = self._cadence.late if self._cadence is not None else 0
        anticipating = int(self._timer is not None)
        return {**self.transport_counters, "late_publishes": late, "anticipating": anticipating}

    def _on_timer(self) -> None:
        """Just before the next expected batch: poll the ring (sleep withdrawn) until it lands
        or the window closes, then take it and declare the sleep again."""
        ring, timer = self._events, self._timer
        if self.closed or ring is None or timer is None:
            return
        if not timer.clear():
            # reported ready together with a doorbell whose drain re-armed the timer for the
            # next window: polling now would spin (sleep withdrawn, so no doorbell) until then
            return
        ring.wake()
        counters = self.transport_counters
        counters["poll_windows"] += 1
        counters["polls_caught"] += poll_until(ring, self._poll_until)
        self._drain_safely()

    def _drain_safely(self) -> None:
        """_drain_events from a loop callback: a protocol error fails the connection."""
        if self.closed:
            return
        try:
            self._drain_events()
        except ProtocolViolation as exc:
            self._fail(ProtocolError(f"invalid data from the daemon: {exc}"))
        except FlareError as exc:
            self._fail(exc)

    def _on_doorbell(self) -> None:
        """The doorbell pipe is readable. Records first (that is what the reader waits for),
        then the byte; the sleep is declared only after the byte is consumed, so a doorbell
        for any record published after that declaration makes the pipe readable again."""
        if self.closed:
            return
        self.transport_counters["doorbell_wakes"] += 1
        try:
            self._take_events()
            doorbell.reset(self._bell_fd)
            self._drain_events()
        except ProtocolViolation as exc:
            self._fail(ProtocolError(f"invalid data from the daemon: {exc}"))
        except FlareError as exc:
            self._fail(exc)

    def _handle(self, msg: m.DaemonMessage) -> None:
        if isinstance(msg, m.EventsReady):
            self._drain_events()
            if msg.writer_blocked:
                self._send(m.Advance())
        elif isinstance(msg, m.TokenDelta):
            q = self._streams.get(msg.request_id)
            if q is not None:
                q.put_nowait(delta_event(msg))
        elif isinstance(msg, m.Finished):
            q = self._streams.pop(msg.request_id, None)
            if q is not None:
                q.put_nowait(finished_event(msg))
        elif isinstance(msg, m.ErrorReply):
            self._handle_error(msg)
        elif isinstance(msg, (m.StatsReply, m.RenderResult, m.Pong)):
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            raise ProtocolViolation(f"unexpected {type(msg).__name__} after the handshake")

    def _handle_error(self, err: m.ErrorReply) -> None:
        if err.request_id:
            q = self._streams.pop(err.request_id, None)
            if q is not None:
                q.put_nowait(from_reply(err))
        elif err.call_id:
            fut = self._calls.pop(err.call_id, None)
            if fut is not None and not fut.done():
                fut.set_exception(from_reply(err))
        else:
            raise from_reply(err)  # a session-level error: the daemon closes the session

    async def _watchdog(self) -> None:
        while not self.closed:
            await asyncio.sleep(PING_AFTER_S / 2)
            if not self._streams and not self._calls:
                continue
            if self._events is not None and self._events.pending():
                try:  # the doorbell wait's timeout: re-check the ring
                    self._drain_events()
                except ProtocolViolation as exc:
                    self._fail(ProtocolError(f"invalid data from the daemon: {exc}"))
                    return
                except FlareError as exc:
                    self._fail(exc)
                    return
            silent = self._loop.time() - self._last_rx
            if silent > self._liveness_timeout_s:
                self._fail(ConnectionLost(f"the daemon has not answered for {silent:.1f}s"))
            elif silent > PING_AFTER_S:
                with contextlib.suppress(FlareError):
                    self._send(m.Ping(0))  # call id 0: an unsolicited ping, its Pong is dropped

    # -- teardown --------------------------------------------------------------------------
    def _fail(self, exc: FlareError) -> None:
        if self.closed:
            return
        self.closed = True
        for q in self._streams.values():
            q.put_nowait(exc)
        self._streams.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()
        self._writer.close()
        if self._bell_fd >= 0:
            self._loop.remove_reader(self._bell_fd)
            os.close(self._bell_fd)
            self._bell_fd = -1
        if self._timer is not None:
            self._loop.remove_reader(self._timer.fd)
            self._timer.close()
            self._timer = None
        for ring in (self._events, self._prompts):
            if ring is not None:
                ring.release()
        for seg in self._segments:
            seg.close()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def close(self) -> None:
        self._fail(ConnectionLost("the client closed the connection"))
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()


def _close_handshake(done: asyncio.Future[Any]) -> None:
    """Close the socket and fds of a handshake whose opener was cancelled meanwhile."""
    if done.cancelled() or done.exception() is not None:
        return
    sock, _welcome, fds = done.result()
    sock.close()
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
