"""The in-process engine API: submit / stream / cancel / stats over one loaded bundle.

The engine loop runs on its own thread. Everything else talks to it through a queue of typed
commands (flared.engine_commands), so the boundary can move to a process later. Events
go back through per-request sinks called on the engine thread; a sink must not block (the
daemon's sinks post to its event loop; `stream()` uses a bounded queue and cancels a consumer
that stops reading).

Loop, per iteration: apply commands; while fewer than two steps are in flight and the scheduler
has work, plan and submit a step; then wait for the oldest step and complete it. Decode reads the
token sampled by the previous step from device state, so step N+1 is submitted before step N's
result is read.

Structured output: a request submitted with a `grammar` (flared.frontend.grammar.RequestGrammar,
compiled by the frontend pool) is `constrained`: the scheduler plans it only when no in-flight
step references it, so at plan time its grammar has accepted every token it generated and the
engine fills its next-token bitmask into the step (the runner applies it inside sampling).
Tokens advance the grammar as their events are dispatched. Unconstrained requests keep two
steps in flight around it.
"""

from __future__ import annotations

import itertools
import logging
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flared.daemon_threads import name_native_thread
from flared.engine.capture import RECURRENT_MIN_CAPTURE_GAP
from flared.engine.errors import Busy, CapacityError, EngineRejection, InvalidRequest
from flared.engine.events import EngineEvent, FinishEvent, TokenEvent
from flared.engine.plan import FinishReason, StepResult
from flared.engine.scheduler import MAX_STEPS_IN_FLIGHT, Scheduler, SchedulerConfig
from flared.engine_commands import Accepted, Sink
from flared.engine_commands import Ack as _Ack
from flared.engine_commands import Cancel as _Cancel
from flared.engine_commands import Notify as _Notify
from flared.engine_commands import Signal as _Signal
from flared.engine_commands import Stop as _Stop
from flared.engine_commands import Submit as _Submit
from flared.engine_config import EngineConfig
from flared.prompts import checked_prompt, prompt_ids
from flared.requests import SamplingParams, resolve_params
from flared.stats import LATENCY_BUCKETS_MS, Histogram

log = logging.getLogger("flared.engine")


__all__ = [
    "Busy",
    "CapacityError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "InvalidRequest",
    "SamplingParams",
    "checked_prompt",
    "prompt_ids",
]


class EngineError(Exception):
    """An execution failed; the engine is in the failed state."""


class Engine:
    def __init__(
        self, bundle_dir: Path | str, config: EngineConfig | None = None, runner_plan: Any = None
    ) -> None:
        """`runner_plan`: a RunnerPlan already derived (the daemon plans before it binds its
        socket, so an unsatisfiable plan fails first); None plans here."""
        from flared.runner.runner import ModelRunner
        from flared.runner.sizing import plan_runner

        self.config = config or EngineConfig()
        self.runner_plan = runner_plan or plan_runner(Path(bundle_dir), self.config)
        self.runner = ModelRunner(bundle_dir, self.runner_plan)
        in_flight = self.config.max_steps_in_flight
        if in_flight is None:
            in_flight = MAX_STEPS_IN_FLIGHT if self.runner.device.type == "cuda" else 1
        if not 1 <= in_flight <= MAX_STEPS_IN_FLIGHT:
            raise ValueError(f"max_steps_in_flight must be 1..{MAX_STEPS_IN_FLIGHT}")
        self.max_steps_in_flight = in_flight
        m = self.runner.manifest
        self.manifest = m
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=self.runner_plan.num_pages,
                page_size=m.geometry.page_size,
                max_num_rows=self.runner_plan.max_num_rows,
                decode_capacities=tuple(m.catalog.decode_capacities),
                max_prefill_chunk_tokens=m.catalog.max_prefill_chunk_tokens,
                max_context_tokens=m.catalog.max_context_tokens,
                max_num_waiting=self.config.max_num_waiting,
                num_snapshot_rows=self.runner_plan.num_snapshot_rows,
                # KV and hidden vectors depend on the weights, their execution dtype and
                # layout, never on the page size (content identity is page-independent)
                model_id=f"{m.checkpoint_fingerprint}/{m.dtype}/{m.kv_dtype}",
                token_layout=f"flare-bundle-{m.format_version}",
                recurrent_state=bool(m.geometry.state_tensors),
                min_capture_gap=RECURRENT_MIN_CAPTURE_GAP if m.geometry.state_tensors else 1,
                prefill_chunk_costs=self._chunk_costs(),
                prefill_fresh_bonus=self._fresh_bonus(),
            )
        )
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._acks: dict[str, _Ack] = {}
        # accepted submissions whose submitter is still blocked: released once the step that
        # admits them is enqueued (or the loop is about to block), so the submitter's wake-up
        # does not take the GIL from the engine thread while it plans and enqueues that step
        self._unreleased: list[threading.Event] = []
        # finish events held back, like `_unreleased`, until the step planned after them is
        # enqueued, when that step makes the request's terminal checkpoint capture: the capture
        # is then on its way before the client (woken by its finish) submits the next turn and
        # contends for the GIL. Only where steps run asynchronously (more than one in flight):
        # on CPU the runner executes a step inside its submit, and the finish would wait for it
        self._held: list[tuple[Sink, FinishEvent]] = []
        self._first_token_out = False  # the step being completed delivered a first token
        self._sinks: dict[str, Sink] = {}
        self._grammars: dict[str, Any] = {}  # request id -> RequestGrammar (engine thread)
        self._in_flight: deque[Any] = deque()
        self._thread: threading.Thread | None = None
        self._prior_switch_interval: float | None = None
        self.state = "starting"
        self.failure: str | None = None
        self._ids = itertools.count()
        self.step_ms = Histogram()
        self.host_ms = Histogram()
        self.submission_gap_ms = Histogram()
        self.device_ms = Histogram()
        # request latency as the engine thread emits tokens (the client adds its transport)
        self.ttft_ms = Histogram(buckets=LATENCY_BUCKETS_MS)
        self.itl_ms = Histogram(buckets=LATENCY_BUCKETS_MS)
        self._submitted_at: dict[str, float] = {}
        self._last_token_at: dict[str, float] = {}
        self._last_step_end: Any = None
        self.steps_total = 0
        self.heartbeat = 0
        self._stats_lock = threading.Lock()
        self._stats_cache: dict[str, Any] = {}

    def _chunk_costs(self) -> tuple[tuple[int, float], ...]:
        costs = self.config.prefill_chunk_costs
        if costs == "measured":
            return tuple(sorted(self.runner.prefill_ms.items()))
        if isinstance(costs, str):
            raise ValueError(
                f"prefill_chunk_costs must be 'measured' or (capacity, ms) pairs: {costs!r}"
            )
        prepared = set(self.manifest.catalog.prefill_capacities)
        unknown = sorted({c for c, _ in costs} - prepared)
        if unknown:
            raise ValueError(f"prefill_chunk_costs name capacities {unknown} the bundle lacks")
        return tuple(sorted((int(c), float(t)) for c, t in costs))

    def _fresh_bonus(self) -> tuple[tuple[int, int, float], ...]:
        """What each fresh prefill execution saved against the paged one at startup, with the
        measured costs only (given costs are the operator's, taken as they are)."""
        if self.config.prefill_chunk_costs != "measured":
            return ()
        bonus = self.runner.fresh_bonus
        return tuple(sorted((cap, least, ms) for cap, (least, ms) in bonus.items()))

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> Engine:
        if self.config.gil_switch_interval_s > 0:
            self._prior_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(self.config.gil_switch_interval_s)
        self._thread = threading.Thread(target=self._loop, name="flare-engine", daemon=True)
        self._thread.start()
        self.state = "ready"
        return self

    def shutdown(self, timeout_s: float = 10.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_Stop())
        self._thread.join(timeout=timeout_s)
        self._thread = None
        if self._prior_switch_interval is not None:  # the process's own setting again
            sys.setswitchinterval(self._prior_switch_interval)
            self._prior_switch_interval = None
        if self.state != "failed":
            self.state = "stopped"

    def abandon(self, reason: str) -> None:
        """Declare the engine failed from another thread: its loop is stuck (an execution that
        never completes) and its owner answers the requests itself. New submits fail with
        EngineError; should the loop ever resume, it stops and fails what it still holds."""
        if self.state != "failed":
            self.failure = reason
            self.state = "failed"

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ----------------------------------------------------------------------------
    def submit(
        self,
        prompt_token_ids: Sequence[int],
        sink: Sink,
        *,
        request_id: str | None = None,
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        ignore_eos: bool = False,
        endpoints: Sequence[int] = (),
        grammar: Any = None,
        timeout_s: float = 30.0,
    ) -> str:
        """Queue a request; raises InvalidRequest / CapacityError / Busy synchronously.
        `grammar`: a RequestGrammar that constrains every sampled token (owned by the engine
        thread from here on)."""
        done, ack = threading.Event(), _Ack()
        rid = self._enqueue(
            prompt_token_ids, sink, done, request_id, max_tokens, sampling, logprobs,
            stop_token_ids, min_tokens, ignore_eos, endpoints, grammar, ack,
        )  # fmt: skip
        if not done.wait(timeout_s):
            raise EngineError(f"engine did not accept request {rid} within {timeout_s}s")
        if self._acks.get(rid) is ack:
            del self._acks[rid]
        if ack.error is not None:
            raise ack.error
        return rid

    def submit_nowait(
        self,
        prompt_token_ids: Sequence[int],
        sink: Sink,
        accepted: Accepted,
        *,
        request_id: str | None = None,
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        logprobs: int = 0,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
        ignore_eos: bool = False,
        endpoints: Sequence[int] = (),
        grammar: Any = None,
    ) -> str:
        """`submit` without waiting for the engine: what is wrong with the arguments raises
        here; the engine thread's verdict (None, or the scheduler's typed rejection) goes to
        `accepted`, at the moment `submit` would have returned. For callers that must not
        block (the daemon's event loop)."""
        ack = _Ack()
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        return self._enqueue(
            prompt_token_ids, sink, _Notify(self._acks, rid, ack, accepted), rid, max_tokens,
            sampling, logprobs, stop_token_ids, min_tokens, ignore_eos, endpoints, grammar, ack,
        )  # fmt: skip

    def _enqueue(
        self,
        prompt_token_ids: Sequence[int],
        sink: Sink,
        done: _Signal,
        request_id: str | None,
        max_tokens: int,
        sampling: SamplingParams | None,
        logprobs: int,
        stop_token_ids: Sequence[int],
        min_tokens: int,
        ignore_eos: bool,
        endpoints: Sequence[int],
        grammar: Any,
        ack: _Ack,
    ) -> str:
        if self.state != "ready":
            raise EngineError(
                f"engine is {self.state}" + (f": {self.failure}" if self.failure else "")
            )
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        m = self.manifest
        params = resolve_params(
            sampling or SamplingParams(),
            m.sampling_defaults,
            max_tokens=max_tokens,
            logprobs=logprobs,
            stop_token_ids=tuple(stop_token_ids),
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            max_top_logprobs=m.catalog.max_top_logprobs,
            max_stop_token_ids=m.catalog.max_stop_token_ids,
            vocab_size=m.geometry.vocab_size,
            constrained=grammar is not None,
        )
        ids, packed = checked_prompt(prompt_token_ids, m.geometry.vocab_size)
        self._acks[rid] = ack
        self._commands.put(_Submit(rid, ids, params, sink, done, tuple(endpoints), grammar, packed))
        if self.state != "ready":  # the loop ended meanwhile: nobody else answers the command
            self._drain_acks()
        return rid

    def cancel(self, request_id: str) -> None:
        self._commands.put(_Cancel(request_id))

    def stream(self, prompt_token_ids: Sequence[int], **kwargs: Any) -> Iterator[EngineEvent]:
        """Blocking iterator over one request's events; ends after its FinishEvent."""
        q: queue.SimpleQueue[EngineEvent] = queue.SimpleQueue()  # its C lock wakes sooner
        rid = self.submit(prompt_token_ids, q.put, **kwargs)
        finished = False
        try:
            while not finished:
                try:
                    ev = q.get(timeout=60.0)
                except queue.Empty:
                    raise EngineError(f"no event for request {rid} within 60s") from None
                finished = isinstance(ev, FinishEvent)
                if finished and ev.reason is FinishReason.ERROR:
                    raise EngineError(f"the engine failed: {self.failure}")
                yield ev
        finally:
            if not finished:  # the consumer stopped early: free the request's resources
                self.cancel(rid)

    def generate(self, prompt_token_ids: Sequence[int], **kwargs: Any) -> GenerateOutput:
        tokens: list[Any] = []
        finish: FinishEvent | None = None
        rid = ""
        for ev in self.stream(prompt_token_ids, **kwargs):
            rid = ev.request_id
            if isinstance(ev, TokenEvent):
                tokens.extend(ev.tokens)
            else:
                finish = ev
        assert finish is not None
        return GenerateOutput(rid, tokens, finish)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            out = dict(self._stats_cache)
        out.update(
            state=self.state,
            steps_total=self.steps_total,
            step_ms=self.step_ms.summary(),
            host_ms=self.host_ms.summary(),
            host_submission_gap_ms=self.submission_gap_ms.summary(),
            ttft_ms=self.ttft_ms.summary(),
            itl_ms=self.itl_ms.summary(),
            device_step_ms=self.device_ms.summary(),
            kv_pages_total=self.runner_plan.num_pages,
            memory=self.runner_plan.memory.as_metrics() if self.runner_plan.memory else {},
            load_memory=dict(self.runner.memory_report),
            # decode steps per decode execution (decode{b}, _lean, _single: which paths serve)
            decode_steps_by_execution=dict(self.runner.steps.decode_runs),
            # prefill chunks per prefill execution (prefill{C}, prefill{C}_fresh)
            prefill_chunks_by_execution=dict(self.runner.steps.prefill_runs),
            # samples without a forward pass per execution: final_sample{,_lean} (a prompt's
            # first token, after its last chunk), resume{b}{,_lean} (full-prompt checkpoint hits)
            samples_by_execution=dict(self.runner.steps.sample_runs),
            # prefill{C}_fresh executions the startup check found wrong (not served)
            prefill_fresh_dropped=list(self.runner.fresh_dropped),
            page_size=self.manifest.geometry.page_size,
        )
        return out

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        name_native_thread()
        sched = self.scheduler
        try:
            while True:
                self.heartbeat += 1  # the watchdog pings only while this advances
                if self.state == "failed":  # given up on (abandon) while an execution hung
                    raise EngineError(str(self.failure))
                if self._apply_commands():
                    break
                while (
                    len(self._in_flight) < self.max_steps_in_flight
                    and sched.has_work()
                    and sched.num_in_flight < self.max_steps_in_flight
                ):
                    plan = sched.plan()
                    # every plan goes through the runner, empty ones too, so that results
                    # reach the scheduler in step order
                    masks = self._masks(plan) if self._grammars else None
                    self._in_flight.append(self.runner.submit(plan, masks))
                    self._release_waiters()
                    if plan.is_empty:
                        break
                    # requests that arrived while this step was planned and submitted join
                    # the next plan now, not after the oldest step completes (an agent's next
                    # turn then restores from the capture this step makes, behind it)
                    if self._apply_commands():
                        return
                self._release_waiters()
                if self._in_flight:
                    self._complete(self.runner.wait(self._in_flight.popleft()))
                else:
                    self._refresh_stats()
                    # idle: block on the command queue itself (its C lock wakes this thread
                    # sooner than an Event), and apply what arrives first, in order
                    try:
                        first = self._commands.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if self._apply_commands(first):
                        break
        except Exception as exc:  # an execution failure fails every request
            log.exception("engine loop failed")
            if self.state != "failed":  # (an owner that gave up on the loop named why first)
                self.failure = f"{type(exc).__name__}: {exc}"
                self.state = "failed"
            self._release_waiters()  # accepted (and earlier finishes) before these finishes
            for rid, sink in list(self._sinks.items()):
                _safe(sink, FinishEvent(rid, FinishReason.ERROR, 0, 0))
            self._sinks.clear()
        finally:
            self._release_waiters()
            self._drain_acks()

    def _apply_commands(self, first: Any = None) -> bool:
        """Apply `first` (a command already taken from the queue), then every queued one; True
        when a _Stop ended the loop."""
        while True:
            if first is not None:
                cmd, first = first, None
            else:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    return False
            if isinstance(cmd, _Stop):
                self._release_waiters()
                for rid in list(self._sinks):
                    self._dispatch(self.scheduler.cancel(rid))
                self._release_waiters()
                while self._in_flight:
                    self._complete(self.runner.wait(self._in_flight.popleft()))
                return True
            if isinstance(cmd, _Cancel):
                self._dispatch(self.scheduler.cancel(cmd.request_id))
                continue
            ack = self._acks.get(cmd.request_id) or _Ack()
            try:
                if cmd.request_id in self._sinks:
                    raise InvalidRequest(f"request id {cmd.request_id!r} is already in use")
                self.scheduler.submit(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.endpoints, cmd.packed
                )
                self._sinks[cmd.request_id] = cmd.sink
                self._submitted_at[cmd.request_id] = time.perf_counter()
                if cmd.grammar is not None:
                    self._grammars[cmd.request_id] = cmd.grammar
            except EngineRejection as exc:
                ack.error = exc
                cmd.done.set()
                continue
            self._unreleased.append(cmd.done)

    def _release_waiters(self) -> None:
        """Wake the submitters of every accepted request (see `_unreleased`) and deliver the
        finish events held back (see `_held`)."""
        if self._unreleased:
            for done in self._unreleased:
                done.set()
            self._unreleased.clear()
        if self._held:
            held, self._held = self._held, []
            for sink, ev in held:
                _safe(sink, ev)

    def _complete(self, result: StepResult) -> None:
        self.steps_total += 1
        self.step_ms.add(result.extra.get("step_s", 0.0) * 1e3)
        self.host_ms.add(result.extra.get("host_s", 0.0) * 1e3)
        gap = result.extra.get("gap_ms")
        if gap is not None:
            self.submission_gap_ms.add(gap)
        device = result.extra.get("device_ms")
        if device is not None:
            self.device_ms.add(device)
        events = self.scheduler.complete(result)
        self._first_token_out = False
        self._dispatch(events)
        self._refresh_stats()
        pause = self.config.dispatch_yield_s
        if pause is None and self._first_token_out:
            pause = self.config.first_token_yield_s
        if events and self._in_flight and pause is not None:
            time.sleep(pause)

    def _dispatch(self, events: list[EngineEvent]) -> None:
        for ev in events:
            sink = self._sinks.get(ev.request_id)
            if sink is None:
                continue
            if isinstance(ev, FinishEvent):
                del self._sinks[ev.request_id]
                self._grammars.pop(ev.request_id, None)
                self._submitted_at.pop(ev.request_id, None)
                self._last_token_at.pop(ev.request_id, None)
                if self.max_steps_in_flight > 1 and self.scheduler.capture_due(ev.request_id):
                    self._held.append((sink, ev))  # delivered by _release_waiters
                    continue
                _safe(sink, ev)
                continue
            self._time_tokens(ev)
            if self._grammars:
                self._advance_grammar(ev)
            _safe(sink, ev)

    def _time_tokens(self, ev: TokenEvent) -> None:
        now = time.perf_counter()
        last = self._last_token_at.get(ev.request_id)
        if last is None:
            self._first_token_out = True
            if (start := self._submitted_at.get(ev.request_id)) is not None:
                self.ttft_ms.add(1e3 * (now - start))
        elif ev.tokens:
            self.itl_ms.add(1e3 * (now - last) / len(ev.tokens))
        self._last_token_at[ev.request_id] = now

    def _masks(self, plan: Any) -> dict[int, Any] | None:
        """Row -> next-token bitmask for every constrained row that samples in `plan`: decode
        rows, a sampling final prefill chunk, and the first sample of a full-prompt hit."""
        import torch

        wanted = list(zip(plan.decode.rows, plan.decode.request_ids)) if plan.decode else []
        if plan.prefill is not None and plan.prefill.sample:
            wanted.append((plan.prefill.row, plan.prefill.request_id))
        if plan.resume is not None:
            wanted += zip(plan.resume.rows, plan.resume.request_ids)
        masks: dict[int, Any] = {}
        for row, rid in wanted:
            g = self._grammars.get(rid)
            if g is not None:
                buf = torch.empty((1, g.num_words), dtype=torch.int32)
                g.fill(buf, 0)
                masks[row] = buf[0]
        return masks or None

    def _advance_grammar(self, ev: TokenEvent) -> None:
        g = self._grammars.get(ev.request_id)
        if g is None:
            return
        for t in ev.tokens:
            if not g.accept(t.token_id):  # the mask allowed it, so this is a bug: say so
                log.error("grammar rejected token %d of %s", t.token_id, ev.request_id)
                self._grammars.pop(ev.request_id, None)
                return

    def _refresh_stats(self) -> None:
        with self._stats_lock:
            self._stats_cache = dict(self.scheduler.stats())

    def _drain_acks(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Submit):
                ack = self._acks.get(cmd.request_id)
                if ack is not None:
                    why = f"failed: {self.failure}" if self.state == "failed" else "stopped"
                    ack.error = EngineError(f"the engine {why}")
                cmd.done.set()


@dataclass
class GenerateOutput:
    request_id: str
    tokens: list[Any]
    finish: FinishEvent

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


def _safe(sink: Sink, ev: EngineEvent) -> None:
    try:
        sink(ev)
    except Exception:
        log.exception("event sink failed for %s", ev.request_id)
