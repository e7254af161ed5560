"""The daemon's core on the event loop: health, sessions, live requests, engine events.

Threads and who owns what:
  event loop     sessions, the live-request registry, rings, every socket write
  engine thread  calls `_sink` only, which appends to `_inbox` and wakes the loop
  frontend pool  render/tokenize, grammar compile, output pipeline + Engine.submit (bounded;
                 full -> Busy)
  lanes          detokenize -> stop strings -> reasoning -> tool calls, encode events; one
                 single-threaded lane per request hash (so one request's events stay in order).
                 A request with no text pipeline (token ids out) is encoded on the loop.

Invariant: a request id is in `live` from its Submit until its terminal message (Finished or
ErrorReply) is handed to its session, or until the engine finishes it after its session died;
only then can the id be reused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from flared.config import DaemonConfig
from flared.daemon_threads import name_native_thread
from flared.engine.events import FinishEvent
from flared.engine.plan import FinishReason
from flared.server.admission import (
    admit,
    admit_direct,
    check_request_id,
    error_code,
    error_text,
    is_direct,
    render_call,
)
from flared.server.delivery import Outgoing, Work, render_batch
from flared.server.live import LiveRequest, engine_id
from flared.server.session import Session
from shm_protocol import messages as m
from shm_protocol.redact import redact

log = logging.getLogger("flared.server")
MONITOR_INTERVAL_S = 0.05
# engine_stall_timeout_s = 0: by device. A CUDA step takes milliseconds (a hang is a driver or
# kernel fault); a CPU step of a large model may take minutes, and nothing hangs it.
ENGINE_STALL_TIMEOUT_S: dict[str, float] = {"cuda": 60.0}


class Service:
    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.health = "starting"
        self.failure: str | None = None
        self.engine: Any = None
        self.frontend: Any = None
        self.runtime: dict[str, Any] = {}  # facts fixed at load (engine_cpu_threads), in stats
        self.sessions: dict[str, Session] = {}
        self.connections = 0  # accepted and allowed: handshaking or in session
        self.connections_by_uid: Counter[int] = Counter()
        self.live: dict[str, LiveRequest] = {}
        self.counters: Counter[str] = Counter()
        self.started_at = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._inbox: deque[Any] = deque()
        self._inbox_lock = threading.Lock()
        self._wake_scheduled = False
        self._pool = ThreadPoolExecutor(
            config.frontend_workers, "flare-front", initializer=name_native_thread
        )
        self._pending_jobs = 0
        self._lanes = [
            ThreadPoolExecutor(1, f"flare-detok{i}", initializer=name_native_thread)
            for i in range(config.detok_lanes)
        ]
        self._beat: tuple[Any, float] | None = None  # engine heartbeat, when it last moved
        self._monitor = self._loop.create_task(self._watch())

    # -- engine attachment -----------------------------------------------------------------
    def attach(self, engine: Any, frontend: Any, runtime: dict[str, Any] | None = None) -> None:
        self.engine, self.frontend = engine, frontend
        self.runtime = dict(runtime or {})
        self.health = "ready"

    def fail(self, reason: str) -> None:
        """Health "failed"; clients (replies, stats) read `reason` without filesystem paths."""
        self.health, self.failure = "failed", redact(reason)

    # -- requests from sessions (loop) -----------------------------------------------------
    def _refusal(self, session: Session, msg: m.Submit) -> tuple[str, str] | None:
        if self.health != "ready":
            if self.health == "failed":
                return m.ENGINE_ERROR, f"the daemon failed: {self.failure}"
            return m.BUSY, f"the daemon is {self.health}; retry later"
        try:
            check_request_id(msg.request_id)
        except Exception as exc:
            return m.INVALID_REQUEST, str(exc)
        if engine_id(session.session_id, msg.request_id) in self.live:
            return m.INVALID_REQUEST, f"request id {msg.request_id!r} is already in use"
        if self._pending_jobs >= self.config.max_pending_frontend_jobs:
            return m.BUSY, "too many requests are waiting for admission; retry later"
        return None

    def submit(self, session: Session, msg: m.Submit) -> None:
        refusal = self._refusal(session, msg)
        prompt = session.read_prompt(msg.prompt_ring_bytes) if msg.prompt_ring_bytes else None
        if refusal is not None:
            self.counters["requests_refused_total"] += 1
            session.send(m.ErrorReply(*refusal, request_id=msg.request_id))
            return
        live = LiveRequest(
            msg.request_id, session, hash(msg.request_id) % len(self._lanes),
            want_logprobs=msg.logprobs > 0,
        )  # fmt: skip
        self.live[live.engine_id] = live
        session.requests.add(live.request_id)
        self._pending_jobs += 1
        prompt = list(msg.prompt_token_ids) if prompt is None else prompt
        if is_direct(msg, prompt):
            try:
                admit_direct(
                    self.engine, self.frontend, self._sink, live, msg, prompt,
                    lambda exc: self._post(self._accepted, live, exc),
                )  # fmt: skip
            except Exception as exc:
                self._accepted(live, exc)
            return
        fut = self._pool.submit(admit, self.engine, self.frontend, self._sink, live, msg, prompt)
        fut.add_done_callback(lambda f: self._post(self._admitted, live, f))

    def _post(self, fn: Any, *args: Any) -> None:
        """Run fn(*args) on the loop (from another thread); nothing once the loop is closed."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the daemon is shutting down
            log.debug("loop closed; dropped %s", getattr(fn, "__name__", fn))

    def _admitted(self, live: LiveRequest, fut: Future[bool]) -> None:
        exc = fut.exception()
        self._accepted(live, exc, exc is None and fut.result())

    def _accepted(self, live: LiveRequest, exc: BaseException | None, ok: bool = True) -> None:
        """The engine took the request (or `exc`; `ok` False: skipped, the client is gone)."""
        self._pending_jobs -= 1
        if exc is not None or not ok:
            # (a request the daemon already ended for its client, e.g. a stalled engine or a
            # slow consumer, got its one terminal reply then)
            if exc is not None and not (live.orphaned or live.terminated):
                self.counters["requests_rejected_total"] += 1
                live.session.send(
                    m.ErrorReply(error_code(exc), error_text(exc), request_id=live.request_id)
                )
            self._release(live)
            return
        live.submitted = True
        self.counters["requests_total"] += 1
        if live.wants_cancel:
            self.engine.cancel(live.engine_id)

    def cancel(self, session: Session, request_id: str) -> None:
        live = self.live.get(engine_id(session.session_id, request_id))
        if live is None:
            return  # not live in this session (other sessions' ids are not in its namespace)
        live.cancel_requested = True
        session.drop(request_id)
        if live.submitted:
            self.engine.cancel(live.engine_id)

    def render(self, session: Session, msg: m.Render) -> None:
        if self._pending_jobs >= self.config.max_pending_frontend_jobs:
            session.send(m.ErrorReply(m.BUSY, "frontend pool is full", call_id=msg.call_id))
            return
        self._pending_jobs += 1
        fut = self._pool.submit(render_call, self.frontend, msg)

        def done(f: Future[m.RenderResult]) -> None:
            self._pending_jobs -= 1
            exc = f.exception()
            if exc is None:
                session.send(f.result())
            else:
                session.send(m.ErrorReply(error_code(exc), error_text(exc), call_id=msg.call_id))

        fut.add_done_callback(lambda f: self._loop.call_soon_threadsafe(done, f))

    def session_closed(self, session: Session) -> None:
        """EOF or error: cancel everything the session had in flight."""
        self.sessions.pop(session.session_id, None)
        for rid in list(session.requests):
            live = self.live.get(engine_id(session.session_id, rid))
            if live is None:
                continue
            live.orphaned = True
            self.counters["requests_orphaned_total"] += 1
            if live.submitted:
                self.engine.cancel(live.engine_id)
        session.requests.clear()

    def _release(self, live: LiveRequest) -> None:
        if self.live.get(live.engine_id) is live:  # (not a later request reusing its id)
            del self.live[live.engine_id]
            live.session.requests.discard(live.request_id)

    # -- engine events ---------------------------------------------------------------------
    def _sink(self, ev: Any) -> None:
        """Engine thread. Never blocks: append and wake the loop at most once per batch."""
        with self._inbox_lock:
            self._inbox.append(ev)
            if self._wake_scheduled:
                return
            self._wake_scheduled = True
        self._loop.call_soon_threadsafe(self._drain_inbox)

    def _drain_inbox(self) -> None:
        with self._inbox_lock:
            events, self._inbox = self._inbox, deque()
            self._wake_scheduled = False
        batches: list[list[Work]] = [[] for _ in self._lanes]
        inline: list[Work] = []
        for ev in events:
            live = self.live.get(ev.request_id)
            if live is None:
                continue
            if live.orphaned or live.terminated:
                if isinstance(ev, FinishEvent):
                    self._release(live)  # nothing to deliver; the id is free again
                continue
            work = Work(ev, live, self._terminal_error(ev, live))
            # a request without a text pipeline (token ids out) only needs its events encoded:
            # done here, without two thread hand-offs (each a wait for the GIL behind the
            # engine thread) between its first token and the client. Whether a request has a
            # pipeline is fixed before the engine knows it, so its events keep one order.
            (inline if live.output is None else batches[live.lane]).append(work)
        if inline:
            self._deliver_all(render_batch(inline))
        for lane, batch in zip(self._lanes, batches):
            if batch:
                fut = lane.submit(render_batch, batch)
                fut.add_done_callback(lambda f: self._loop.call_soon_threadsafe(self._deliver, f))

    def _terminal_error(self, ev: Any, live: LiveRequest) -> m.ErrorReply | None:
        if not isinstance(ev, FinishEvent):
            return None
        if ev.reason == FinishReason.ERROR:
            if self.health != "failed":  # before the client hears it, not at the next tick
                log.error("engine failed: %s", self.engine.failure)
                self.fail(str(self.engine.failure))
            reason = f"the engine failed: {self.failure}"
            return m.ErrorReply(m.ENGINE_ERROR, reason, request_id=live.request_id)
        # (a failure is its own reason now, so a "cancelled" is always a cancellation)
        if ev.reason == FinishReason.CANCELLED and live.daemon_cancel_reason is not None:
            return m.ErrorReply(m.CANCELLED, live.daemon_cancel_reason, request_id=live.request_id)
        return None

    def _deliver(self, fut: Future[list[Outgoing]]) -> None:
        exc = fut.exception()
        if exc is not None:  # a bug in rendering; fail loudly but keep serving
            log.error("event rendering failed", exc_info=exc)
            return
        self._deliver_all(fut.result())

    def _deliver_all(self, outgoing: list[Outgoing]) -> None:
        touched: dict[str, Session] = {}
        alone = len(outgoing) == 1  # one event (one stream): published as it is enqueued
        for out in outgoing:
            live = out.live
            if out.finish_engine:  # a stop string ended the output: free the request now
                if live.submitted:
                    self.engine.cancel(live.engine_id)
                else:
                    live.cancel_requested = True  # applied once admission reports back
            if not (live.orphaned or live.terminated):
                if alone:
                    live.session.publish_one(live.request_id, out.payload, out.terminal)
                else:
                    live.session.enqueue(live.request_id, out.payload, out.terminal)
                touched[live.session.session_id] = live.session
            if out.terminal:
                self._release(live)
        for session in touched.values():
            if not alone:
                session.flush()
            if session.overflowed:
                self._cancel_slow(session, "its event backlog is full")

    # -- slow consumers, health ------------------------------------------------------------
    def _cancel_slow(self, session: Session, why: str) -> None:
        session.overflowed = False
        for rid in list(session.requests):
            live = self.live.get(engine_id(session.session_id, rid))
            if live is None or live.terminated:
                continue
            live.terminated = True
            session.drop(rid)
            self.counters["slow_consumer_cancels_total"] += 1
            text = f"request cancelled: the client stopped reading events ({why})"
            session.send(m.ErrorReply(m.CANCELLED, text, request_id=rid))
            if live.submitted:
                self.engine.cancel(live.engine_id)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                session.flush()  # retry a full ring (a lost Advance costs one interval)
                stalled = session.stalled_for(now)
                if stalled > self.config.stall_timeout_s and session.requests:
                    self._cancel_slow(session, f"no progress for {stalled:.1f}s")
            if self.engine is None or self.health == "failed":
                continue
            if self.engine.state == "failed":
                log.error("engine failed: %s", self.engine.failure)
                self.fail(str(self.engine.failure))
            else:
                self._check_engine_progress(now)

    def _check_engine_progress(self, now: float) -> None:
        """An engine loop that stops moving (a hung execution: no exception will ever come)
        fails the daemon after engine_stall_timeout_s: every live request gets EngineError
        now instead of waiting forever, and new ones are refused. The loop advances its
        heartbeat when idle too, so a quiet engine is not a stalled one."""
        limit = self.config.engine_stall_timeout_s or ENGINE_STALL_TIMEOUT_S.get(
            self.engine.runner_plan.device
        )
        if limit is None:
            return
        beat = self.engine.heartbeat
        if self._beat is None or self._beat[0] != beat:
            self._beat = (beat, now)
            return
        stalled = now - self._beat[1]
        if stalled <= limit:
            return
        reason = f"the engine made no progress for {stalled:.1f}s (a hung execution)"
        log.error("%s; failing every request", reason)
        self.engine.abandon(reason)
        self.fail(reason)
        for live in list(self.live.values()):
            if not (live.orphaned or live.terminated):
                live.terminated = True
                live.session.drop(live.request_id)
                text = f"the engine failed: {reason}"
                live.session.send(m.ErrorReply(m.ENGINE_ERROR, text, request_id=live.request_id))
            self._release(live)
        self.counters["engine_stalls_total"] += 1

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.engine.stats()) if self.engine is not None else {}
        out.update(
            daemon_uptime_s=round(time.monotonic() - self.started_at, 3),
            sessions=len(self.sessions),
            connections=self.connections,
            requests_live=len(self.live),
            frontend_jobs_pending=self._pending_jobs,
            failure=self.failure,
            **self.runtime,
            **self.counters,
        )
        return out

    # -- shutdown --------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting, let in-flight requests finish within the drain timeout, cancel the
        rest (their clients get a Cancelled error), then close every session."""
        self.health = "draining" if self.health != "failed" else self.health
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.live:
            reason = f"the daemon is shutting down (drain timeout {self.config.drain_timeout_s}s)"
            for live in list(self.live.values()):
                live.daemon_cancel_reason = reason
                if live.submitted:
                    self.engine.cancel(live.engine_id)
            end = time.monotonic() + 5.0
            while self.live and time.monotonic() < end:
                await asyncio.sleep(0.02)
        for session in list(self.sessions.values()):
            await session.close(drain_s=1.0)
        self._monitor.cancel()

    def shutdown_pools(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for lane in self._lanes:
            lane.shutdown(wait=True)
