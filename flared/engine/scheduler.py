"""Plans each engine step and turns step results into per-request events. Pure CPU.

Policy of one `plan()`:

    1. decode    every runnable row, oldest admission first, at most max(decode_capacities);
                 each row's pages first grow to cover next_pos + 1 (preempting if short).
    2. admit     strict FIFO from the waiting queue while a row and the reservation are free;
                 a blocked head blocks everyone behind it. Skipped in a plan short of pages.
    3. prefill   at most one chunk, for the oldest admitted request still catching up to its
                 prompt, clipped at its next captured endpoint when the model has recurrent
                 state (a checkpoint of such state exists only at a chunk end); with measured
                 chunk costs, the first chunk of the cheapest cut of the rest of the segment.

Page rules (P = page_size, L = prompt length of the request's current life):

    admission    reserves and allocates ceil(L / P) + 1 pages: the prompt's pages plus one page
                 for generation, and writes all of them to the row's page table.
    growth       before a row decodes the pending token at position next_pos, it must own pages
                 covering position next_pos + 1, i.e. at least (next_pos + 1) // P + 1 pages.
    preemption   when growth finds the pool short, the newest running request (by admission) is
                 recomputed later: it frees its row and pages and rejoins the FRONT of the queue
                 with prompt := original prompt + confirmed outputs. A request is only preempted
                 when no in-flight step references it; otherwise the planner waits a step. When
                 the request that cannot grow is the only running one, it finishes CAPACITY.

Two steps may be in flight (one for a grammar-constrained request: its mask needs its previous
token, so it decodes only when no in-flight step references it). `plan()` counts optimistically: every decode row planned yields a
token. Rows and pages of a finished request are released only once every step that referenced
it has completed; a device-side finish learned late costs one extra decode row whose result comes
back valid=False and is ignored.

Prefix cache (flared/engine/prefix_cache.py; off when the config has no snapshot rows):

    admission    looks up the longest cached checkpoint prefix of the life's prompt: its chain
                 pages are shared (only the rest of the reservation is allocated, evicting
                 cached checkpoints first when short), a RestoreOp restores its snapshot row
                 and copies its partial tail page, and prefill starts at its token count; a
                 full-prompt hit samples from the saved hidden vector (ResumeOp) instead.
                 A pending checkpoint written by an earlier step serves as a hit at once
                 (steps run in order), unless another checkpoint shares its key. While a
                 longer prefix is owed (the terminal capture a finished request has not
                 planned yet) or written in this very step, the head waits for it: an agent's
                 next turn, sent the moment the previous one finished, resumes after that
                 turn's whole output, one step after its capture.
    captures     the snapshot budget selects endpoints (with recurrent state, none closer
                 than min_capture_gap to either end of the uncached suffix: each would cost a
                 prefill execution of its own); a SnapshotOp at the end of the step
                 whose chunk reaches one captures it at its exact count. With recurrent state
                 chunks clip there; without it a chunk may run past several captures, whose
                 checkpoints are then their pages alone (no hidden vector to sample from). A finished
                 request (not cancelled) and a preemption victim capture their terminal
                 consumed boundary in the next plan that no in-flight step prevents, handing
                 their tail page to the snapshot. Checkpoints are published when the step
                 that copies them completes; a preempted request is readmitted only then.
    pressure     growth evicts cached checkpoints (least recently used leaves or removable
                 ancestors), then unpins the running requests' own checkpoints and evicts
                 again, and waits instead of preempting while pages are about to come back
                 (fenced, releasing, or held by a checkpoint not yet published). A victim keeps
                 its terminal checkpoint only when the pages it frees besides cover the growth.
                 Admission waits while a pinned hit blocks it and pages will come back, and
                 otherwise admits as a miss, so the cache never deadlocks admission.

Limits: a request generates at most max_tokens tokens, and prompt + outputs never exceed
max_context_tokens; the scheduler never plans past either and emits LENGTH / CAPACITY itself when
the device did not.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from flared.engine.chunking import ChunkCosts, next_chunk_tokens
from flared.engine.config import SchedulerConfig, check_prompt_fits, check_submission
from flared.engine.errors import Busy, CapacityError, InvalidRequest
from flared.engine.events import EngineEvent, FinishEvent, TokenEvent
from flared.engine.plan import (
    DecodeOp,
    FinishReason,
    PrefillOp,
    RequestParams,
    RestoreOp,
    ResumeOp,
    SampledToken,
    SnapshotOp,
    StepPlan,
    StepResult,
)
from flared.engine.prefix_cache import Capture, PrefixCache
from flared.engine.request import Request, Status
from flared.engine.resources import ResourceManager, kv_slots

MAX_STEPS_IN_FLIGHT = 2

__all__ = ["MAX_STEPS_IN_FLIGHT", "Scheduler", "SchedulerConfig"]


@dataclass
class _PlanContext:
    step_id: int
    excluded: set[Request] = field(default_factory=set)  # to be preempted once not in flight
    under_pressure: bool = False  # some row could not grow in this plan
    finished: list[Request] = field(default_factory=list)  # finished inside this plan
    restores: list[RestoreOp] = field(default_factory=list)
    resume: list[Request] = field(default_factory=list)  # full-prompt hits admitted now
    snapshots: list[SnapshotOp] = field(default_factory=list)
    captures: list[Capture] = field(default_factory=list)


@dataclass(frozen=True)
class _StepRecord:
    step_id: int
    decode: tuple[tuple[int, Request], ...]  # (row, request) in DecodeOp order
    prefill: Request | None
    prefill_tokens: int
    sample: bool
    finished: tuple[Request, ...]
    resumed: tuple[tuple[int, Request], ...] = ()
    captures: tuple[Capture, ...] = ()


class Scheduler:
    """Request lifecycle, admission, chunked prefill, decode batching and preemption."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._resources = ResourceManager(
            config.num_pages, config.page_size, config.max_num_rows, config.num_snapshot_rows
        )
        self._cache = PrefixCache(config, self._resources)
        costs, bonus = config.prefill_chunk_costs, config.prefill_fresh_bonus
        self._chunk_costs = ChunkCosts(costs, fresh_bonus=bonus) if costs else None
        self._live: dict[str, Request] = {}  # ids whose FinishEvent has not been emitted
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # admission order (oldest first)
        self._releasing: list[Request] = []  # DONE, row still referenced by an in-flight step
        self._in_flight: deque[_StepRecord] = deque()
        self._next_step_id = 0
        self._last_completed_step_id = -1
        self._next_uid = 0
        self._next_admit_seq = 0
        self._num_prompt_tokens = 0
        self._num_generated_tokens = 0
        self._num_preemptions = 0
        self._num_finished = 0
        self._num_cancelled = 0

    # -- submission -------------------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: RequestParams,
        endpoints: Sequence[int] = (),
        packed: bytes | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequest, CapacityError or Busy; then nothing changed.

        `endpoints`: exact checkpoint offsets, strictly increasing and strictly inside the prompt.
        `packed`: the prompt as little-endian int64s, if the caller has it (passed on to the
        admission of the request's first life, which uploads it as is).
        """
        prompt = tuple(prompt_token_ids)
        ends = tuple(endpoints)
        if request_id in self._live:
            raise InvalidRequest(f"request id {request_id!r} is already live")
        check_submission(self.config, prompt, params, ends)
        if len(self._waiting) >= self.config.max_num_waiting:
            raise Busy(f"the waiting queue is full ({self.config.max_num_waiting} requests)")
        if packed is not None and len(packed) != 8 * len(prompt):
            raise InvalidRequest("the packed prompt does not match the prompt's length")
        req = Request(self._next_uid, request_id, prompt, params, ends, packed=packed)
        self._next_uid += 1
        self._live[request_id] = req
        self._waiting.append(req)

    def cancel(self, request_id: str) -> list[EngineEvent]:
        """Finish a live request as CANCELLED at once; unknown or finished ids return [].

        No later event concerns this request. Its row and pages are released once no in-flight
        step references them; the id may be submitted again immediately.
        """
        req = self._live.get(request_id)
        if req is None:
            return []
        if req.status is Status.WAITING:
            self._waiting.remove(req)
        events: list[EngineEvent] = []
        self._finish(req, FinishReason.CANCELLED, events)
        return events

    # -- planning ---------------------------------------------------------------------------

    def plan(self) -> StepPlan:
        """The next step. Every plan returned must later be passed to complete(), in order."""
        if len(self._in_flight) >= MAX_STEPS_IN_FLIGHT:
            raise RuntimeError(f"{MAX_STEPS_IN_FLIGHT} steps are already in flight")
        ctx = _PlanContext(self._next_step_id)
        self._next_step_id += 1
        self._capture_leaving(ctx)
        decode_rows = self._plan_decode(ctx)
        admitted = [] if ctx.under_pressure else self._admit_waiting(ctx)
        prefill, prefill_req = self._plan_prefill(ctx)
        referenced = [*decode_rows, *admitted, *([prefill_req] if prefill_req else [])]
        host_dependency = not any(self._is_in_flight(r) for r in referenced)
        for req in referenced:
            req.last_step_id = ctx.step_id
        self._in_flight.append(
            _StepRecord(
                step_id=ctx.step_id,
                decode=tuple((r.row, r) for r in decode_rows),
                prefill=prefill_req,
                prefill_tokens=len(prefill.token_ids) if prefill else 0,
                sample=prefill.sample if prefill else False,
                finished=tuple(ctx.finished),
                resumed=tuple((r.row, r) for r in ctx.resume),
                captures=tuple(ctx.captures),
            )
        )
        decode = None
        if decode_rows:
            decode = DecodeOp(
                rows=tuple(r.row for r in decode_rows),
                request_ids=tuple(r.request_id for r in decode_rows),
            )
        return StepPlan(
            step_id=ctx.step_id,
            page_table_writes=self._resources.take_writes(),
            released_rows=self._resources.take_released(),
            admits=tuple(r.admit_op() for r in admitted),
            decode=decode,
            prefill=prefill,
            host_dependency=host_dependency,
            restores=tuple(ctx.restores),
            resume=ResumeOp(
                tuple(r.row for r in ctx.resume), tuple(r.request_id for r in ctx.resume)
            )
            if ctx.resume
            else None,
            snapshots=tuple(ctx.snapshots),
        )

    def _capture_leaving(self, ctx: _PlanContext) -> None:
        """Terminal captures of finished requests that no in-flight step references; each is
        released here (its row fenced by this step)."""
        still: list[Request] = []
        for req in self._releasing:
            if req.capture_terminal and not self._is_in_flight(req):
                req.capture_terminal = False
                self._add_capture(ctx, *self._cache.capture_leaving(req, ctx.step_id))
            else:
                still.append(req)
        self._releasing = still

    def capture_due(self, request_id: str) -> bool:
        """Whether finished `request_id` owes the terminal capture the next plan will make."""
        releasing = (r for r in self._releasing if r.request_id == request_id)
        return any(r.capture_terminal and not self._is_in_flight(r) for r in releasing)

    @staticmethod
    def _add_capture(ctx: _PlanContext, cap: Capture | None, op: SnapshotOp | None) -> None:
        if cap is not None and op is not None:
            ctx.captures.append(cap)
            ctx.snapshots.append(op)

    def _release(self, req: Request) -> None:
        self._cache.release(req)
        self._resources.release(req)

    def _plan_decode(self, ctx: _PlanContext) -> list[Request]:
        rows: list[Request] = []
        for req in list(self._running):  # preemption edits the list
            if len(rows) == self.config.max_decode_rows:
                break
            if self._is_decodable(req, ctx) and self._ensure_pages(req, ctx):
                req.num_life_outputs_scheduled += 1
                rows.append(req)
        return rows

    def _is_decodable(self, req: Request, ctx: _PlanContext) -> bool:
        """Prefilled, still RUNNING, and one more output stays within both limits. A
        constrained request waits until no step in flight references it (one step in flight)."""
        return (
            req.status is Status.RUNNING
            and req.is_prefill_scheduled
            and req not in ctx.excluded
            and not (req.params.constrained and self._is_in_flight(req))
            and req.num_scheduled_outputs < req.params.max_tokens
            and len(req.prompt_token_ids) + req.num_scheduled_outputs
            < self.config.max_context_tokens
        )

    def _ensure_pages(self, req: Request, ctx: _PlanContext) -> bool:
        """Grow `req` to cover position next_pos + 1, preempting newer requests if needed."""
        need = self._resources.pages_for_positions(req.next_pos + 2)
        while not self._resources.grow(req, need):
            ctx.under_pressure = True
            if not self._make_room(req, ctx, need - len(req.pages)):
                return False
        return True

    def _make_room(self, req: Request, ctx: _PlanContext, missing: int) -> bool:
        """Try to free pages for `req`. True: pages were freed and growth may be retried."""
        if self._cache.evict_one_for_pages():
            return True
        if self._cache.drop_anchors(self._running):
            return True  # their checkpoints may be evictable now
        if self._pages_will_return(include_running=False):
            return False  # those pages return when their steps complete: wait, do not preempt
        victim = self._running[-1]
        if self._is_in_flight(victim):
            ctx.excluded.add(victim)  # keep it out of this plan so a later one can preempt it
            return False
        if victim is req and len(self._running) == 1:
            self._finish_in_plan(req, FinishReason.CAPACITY, ctx)  # alone and still too big
            return False
        self._preempt(victim, ctx, 0 if victim is req else missing)
        return victim is not req

    def _pages_will_return(self, include_running: bool = True) -> bool:
        """Whether pages come back without preemption: from finished requests awaiting release,
        fenced ids, checkpoints about to publish (then evictable), or running requests."""
        return bool(
            any(r.pages for r in self._releasing)
            or self._resources.num_fenced_pages
            or self._cache.store.has_pending
            or (include_running and self._running)
        )

    def _preempt(self, victim: Request, ctx: _PlanContext, missing: int) -> None:
        """Recompute `victim` later. Its terminal checkpoint is captured only if the pages it
        does not keep cover the `missing` pages of the request that must grow."""
        cap, op = self._cache.capture_leaving(victim, ctx.step_id, missing)  # releases victim
        if cap is not None:
            self._add_capture(ctx, cap, op)
            victim.awaiting = cap.checkpoint
            self._cache.num_preemption_checkpoints += 1
        self._running.remove(victim)
        victim.start_new_life()
        self._num_preemptions += 1
        try:
            check_prompt_fits(self.config, len(victim.life_prompt))
        except CapacityError:
            victim.awaiting = None
            self._finish_in_plan(victim, FinishReason.CAPACITY, ctx)
            return
        self._waiting.appendleft(victim)

    def _finish_in_plan(self, req: Request, reason: FinishReason, ctx: _PlanContext) -> None:
        """Finish a request referenced by no in-flight step; its FinishEvent leaves with the
        completion of this plan (plan() returns no events). Until then its id stays live."""
        if req.status is Status.RUNNING:
            self._release(req)
            self._running.remove(req)
        req.status = Status.FINISHING
        req.finish_reason = reason
        ctx.finished.append(req)

    def _admit_waiting(self, ctx: _PlanContext) -> list[Request]:
        admitted: list[Request] = []
        while self._waiting:
            req = self._waiting[0]
            if req.awaiting is not None:
                break  # its terminal checkpoint publishes when the step completes
            if self._resources.rows.num_free < 1:
                break  # strict FIFO: the head waits and nobody passes it
            num_pages = self.config.admission_pages(len(req.life_prompt))
            hit = self._cache.lookup(req, ctx.step_id)
            if self._cache.coming(req, hit, self._releasing):
                if hit is not None:
                    self._cache.unpin(hit)
                break  # a longer prefix publishes when an in-flight or planned step completes
            shared = self._cache.shared_pages(hit)
            if hit is not None and not self._cache.reclaim_pages(num_pages - len(shared)):
                self._cache.unpin(hit)
                if self._pages_will_return():
                    break  # wait for them, keeping the hit
                # nothing else will free pages and the pinned hit may hold the very pages
                # needed (its tail pages): admit as a miss, which may evict it
                hit, shared = None, []
            if not self._cache.reclaim_pages(num_pages - len(shared)):
                break
            self._waiting.popleft()
            self._resources.admit(req, num_pages, shared)
            req.status = Status.RUNNING
            req.admit_seq = self._next_admit_seq
            self._next_admit_seq += 1
            restore = self._cache.admitted(req, hit, ctx.step_id)
            if restore is not None:
                ctx.restores.append(restore)
            if req.is_prefill_scheduled:  # a full-prompt hit: sample from the saved hidden
                req.num_life_outputs_scheduled = 1
                ctx.resume.append(req)
            self._running.append(req)
            admitted.append(req)
        return admitted

    def _plan_prefill(self, ctx: _PlanContext) -> tuple[PrefillOp | None, Request | None]:
        for req in self._running:
            if req.is_prefill_scheduled or req in ctx.excluded:
                continue
            start = req.num_prefill_scheduled
            prompt_len = len(req.life_prompt)
            # a recurrent checkpoint exists only at a chunk end; KV checkpoints are pages, so one
            # chunk may hold several captures; without the cache nothing is captured
            clip = req.captures if self._cache.enabled and self.config.recurrent_state else ()
            n = next_chunk_tokens(
                start, prompt_len, self.config.max_prefill_chunk_tokens, clip, self._chunk_costs
            )
            slots = kv_slots(req.pages, self.config.page_size, start, start + n)
            sample = start + n == prompt_len
            req.num_prefill_scheduled += n
            if sample:
                req.num_life_outputs_scheduled = 1  # the final chunk samples the first output
            op = PrefillOp(
                req.request_id, req.row, req.life_prompt[start : start + n], start, slots, sample
            )
            for end in req.captures:  # ascending: each capture chains on the previous one
                if start < end <= start + n:
                    cap = self._cache.capture_live(req, end, ctx.step_id, end < start + n)
                    if cap is not None:
                        self._add_capture(ctx, cap, self._cache.snapshot_op(cap))
            return op, req
        return None, None

    def _is_in_flight(self, req: Request) -> bool:
        return req.last_step_id > self._last_completed_step_id

    # -- completion -------------------------------------------------------------------------

    def complete(self, result: StepResult) -> list[EngineEvent]:
        """Consume the result of the oldest in-flight step; returns its events in row order.

        Raises ValueError (changing nothing) for a result that does not answer that step's plan,
        including a failed step (`error` set): a failed step is the engine's to handle.
        """
        if not self._in_flight:
            raise RuntimeError("complete() without a step in flight")
        rec = self._in_flight[0]
        if result.step_id != rec.step_id:
            raise ValueError(f"result of step {result.step_id}, expected step {rec.step_id}")
        if result.error is not None:
            raise ValueError(f"step {rec.step_id} failed: {result.error}")
        pairs = self._match(rec, result)
        self._in_flight.popleft()
        self._last_completed_step_id = rec.step_id
        self._resources.step_completed(rec.step_id)
        self._cache.step_completed(rec.captures)
        self._num_prompt_tokens += rec.prefill_tokens
        events: list[EngineEvent] = []
        for req, token in pairs:
            self._accept(req, token, events)
        for req in rec.finished:
            if req.status is Status.FINISHING:  # not cancelled meanwhile
                self._finish(req, req.finish_reason, events)
        self._release_unreferenced()
        return events

    def _match(self, rec: _StepRecord, result: StepResult) -> list[tuple[Request, SampledToken]]:
        by_row = {t.row: t for t in result.decoded}
        if len(by_row) != len(result.decoded) or set(by_row) != {row for row, _ in rec.decode}:
            raise ValueError(f"step {rec.step_id}: decoded rows do not match the plan")
        pairs = [(req, by_row[row]) for row, req in rec.decode]
        if rec.sample != (result.prefilled is not None):
            raise ValueError(f"step {rec.step_id}: prefill sample does not match the plan")
        if rec.prefill is not None and result.prefilled is not None:
            pairs.append((rec.prefill, result.prefilled))
        resumed = {t.row: t for t in result.resumed}
        if len(resumed) != len(result.resumed) or set(resumed) != {r for r, _ in rec.resumed}:
            raise ValueError(f"step {rec.step_id}: resumed rows do not match the plan")
        pairs.extend((req, resumed[row]) for row, req in rec.resumed)
        for req, token in pairs:
            if token.request_id != req.request_id:
                raise ValueError(f"step {rec.step_id}: row {token.row} is not {req.request_id!r}")
            if not token.valid and req.status is Status.RUNNING:
                raise ValueError(
                    f"step {rec.step_id}: {req.request_id!r} ended on the device unseen"
                )
        return pairs

    def _accept(self, req: Request, token: SampledToken, events: list[EngineEvent]) -> None:
        if not token.valid or req.status is not Status.RUNNING:
            return  # finished on the device earlier, or cancelled: nothing to report
        req.output_token_ids.append(token.token_id)
        self._num_generated_tokens += 1
        events.append(TokenEvent(req.request_id, (token,)))
        reason = token.finish_reason
        if reason is FinishReason.NONE:
            num_outputs = len(req.output_token_ids)
            if num_outputs >= req.params.max_tokens:
                reason = FinishReason.LENGTH
            elif len(req.prompt_token_ids) + num_outputs >= self.config.max_context_tokens:
                reason = FinishReason.CAPACITY
        if reason is not FinishReason.NONE:
            self._finish(req, reason, events)

    def _finish(self, req: Request, reason: FinishReason, events: list[EngineEvent]) -> None:
        events.append(
            FinishEvent(
                req.request_id,
                reason,
                len(req.prompt_token_ids),
                len(req.output_token_ids),
                req.cached_tokens,
            )
        )
        was_running = req.status is Status.RUNNING
        req.status = Status.DONE
        req.finish_reason = reason
        del self._live[req.request_id]
        self._num_finished += 1
        self._num_cancelled += reason is FinishReason.CANCELLED
        if was_running:
            self._running.remove(req)
            req.capture_terminal = self._cache.enabled and reason is not FinishReason.CANCELLED
            if self._is_in_flight(req) or req.capture_terminal:
                self._releasing.append(req)
            else:
                self._release(req)

    def _release_unreferenced(self) -> None:
        still: list[Request] = []
        for req in self._releasing:
            if self._is_in_flight(req) or req.capture_terminal:
                still.append(req)
            else:
                self._release(req)
        self._releasing = still

    # -- introspection ----------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether plan() has anything to do. Steps in flight are counted by num_in_flight."""
        return bool(
            self._waiting
            or self._running
            or self._resources.has_pending_writes
            or any(r.capture_terminal for r in self._releasing)
        )

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def stats(self) -> dict[str, int]:
        """Gauges and counters. prompt_tokens_total counts prefilled tokens of completed steps,
        recomputation included; requests_finished_total counts every FinishEvent, cancels too."""
        res = self._resources
        return {
            "pages_total": res.pages.num_total,
            "pages_free": res.pages.num_free,
            "state_rows_total": res.rows.num_total,
            "state_rows_free": res.rows.num_free,
            "requests_running": len(self._running),
            "requests_waiting": len(self._waiting),
            "prompt_tokens_total": self._num_prompt_tokens,
            "generated_tokens_total": self._num_generated_tokens,
            "preemptions_total": self._num_preemptions,
            "requests_finished_total": self._num_finished,
            "requests_cancelled_total": self._num_cancelled,
            **self._cache.stats(),
        }

    def reset_prefix_cache(self) -> int:
        """Evict every checkpoint no live request pins; returns how many were retired."""
        return self._cache.store.evict_all()

    def check_integrity(self) -> None:
        """Raise AssertionError unless every pool, mirror and request counter is consistent."""
        refs, snapshots = self._cache.store.check_integrity()
        holders = [*self._running, *self._releasing]
        self._resources.check_integrity(holders, refs, snapshots)
        cfg = self.config

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        require(len(self._in_flight) <= MAX_STEPS_IN_FLIGHT, "too many steps in flight")
        seqs = [r.admit_seq for r in self._running]
        require(seqs == sorted(set(seqs)), "running requests out of admission order")
        for req in self._running:
            require(self._live.get(req.request_id) is req, f"{req.request_id}: not live")
            req.check_running(cfg.page_size, cfg.max_pages_per_row, cfg.max_context_tokens)
        for req in self._waiting:
            require(req.status is Status.WAITING and not req.pages, "waiting request holds pages")
            require(self._live.get(req.request_id) is req, f"{req.request_id}: not live")
        for req in self._releasing:
            require(
                req.status is Status.DONE and (self._is_in_flight(req) or req.capture_terminal),
                "stale release",
            )
        self._cache.check_anchors(holders, list(self._waiting))
        for req in self._live.values():
            require(req.status is not Status.DONE, f"{req.request_id}: done but live")
        require(
            len(self._live) >= len(self._running) + len(self._waiting), "requests lost from live"
        )
