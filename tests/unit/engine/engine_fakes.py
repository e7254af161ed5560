"""Test helpers for the scheduler: a factory, a pure-Python fake device and a step driver.

The fake device executes `StepPlan`s the way the runner does, from its own state only: a page
table built from `PageTableWrite`s, per-row request state built from `AdmitOp`s, a KV store
keyed by physical slot whose entries name their content (position and a digest of the whole
history up to it), and snapshot rows written by `SnapshotOp`s and read by `RestoreOp`s. It
checks on every step that the plan is executable (slot mappings match its page table, pages are
mapped one position ahead, a page is written only through the one row that maps it, every live
row's KV history is intact, a restore installs exactly the prompt's prefix, a snapshot is taken
at the row's exact consumed count, or past it only inside a chunk of a model without
recurrent state) and enforces EOS / stop ids / max_tokens / the context limit
like the device request state does. With `content_sampling` the sampled token also depends on
the row's consumed history, and a full-prompt hit samples from the snapshot's saved "hidden
vector" (the digest of the row's last consumed token when the snapshot was taken), so a
restored row continues exactly like a cold one only if its restored state is exact.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flared.engine.events import EngineEvent, FinishEvent, TokenEvent
from flared.engine.plan import (
    NO_PAGE,
    NULL_ROW,
    FinishReason,
    PageCopy,
    PrefillOp,
    RequestParams,
    RestoreOp,
    SampledToken,
    SnapshotOp,
    StepPlan,
    StepResult,
)
from flared.engine.scheduler import Scheduler, SchedulerConfig

DEFAULTS: dict[str, Any] = {
    "num_pages": 64,
    "page_size": 4,
    "max_num_rows": 8,
    "decode_capacities": (1, 2, 4, 8),
    "max_prefill_chunk_tokens": 16,
    "max_context_tokens": 256,
    "max_num_waiting": 64,
}


def create_scheduler(**overrides: Any) -> Scheduler:
    return Scheduler(SchedulerConfig(**{**DEFAULTS, **overrides}))


def token_for(seed: int, counter: int, vocab_size: int) -> int:
    """The fake sampler: a deterministic function of the row's seed and its output counter."""
    return (seed * 2654435761 + counter * 40503 + 12345) % (2**31) % vocab_size


def content_token(seed: int, counter: int, history_digest: int, vocab_size: int) -> int:
    """The content-sampling fake: also a function of the consumed history."""
    return hash((seed, counter, history_digest)) % vocab_size


@dataclass
class _Row:
    life: int  # distinguishes successive admissions, also of the same request id
    request_id: str
    prompt: tuple[int, ...]
    params: RequestParams
    consumed: int = 0
    generated: int = 0
    finished: bool = False
    outputs: list[int] = field(default_factory=list)
    digests: list[int] = field(default_factory=list)  # digests[i]: history 0..i
    restored: bool = False
    hidden: int | None = None  # the saved hidden vector a restore installed

    def token_at(self, pos: int) -> int:
        return self.prompt[pos] if pos < len(self.prompt) else self.outputs[pos - len(self.prompt)]

    def consume(self, pos: int) -> int:
        assert pos == self.consumed == len(self.digests)
        prev = self.digests[-1] if self.digests else 0
        self.digests.append(hash((prev, self.token_at(pos))))
        self.consumed += 1
        self.hidden = None  # a forward pass computes the hidden vector anew
        return self.digests[-1]


@dataclass(frozen=True)
class _Snapshot:
    history: tuple[int, ...]
    digests: tuple[int, ...]
    hidden: int  # digest of the row's last consumed token when it was taken


class FakeDevice:
    def __init__(
        self,
        config: SchedulerConfig,
        *,
        eos_token_id: int | None = None,
        vocab_size: int = 1000,
        enforce_limits: bool = True,
        content_sampling: bool = False,
    ) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.enforce_limits = enforce_limits
        self.content_sampling = content_sampling
        self.table: dict[tuple[int, int], int] = {}  # stale entries of free rows included
        self.live: set[int] = set()  # rows admitted and not released since
        self.rows: dict[int, _Row] = {}
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, history digest)
        self.snapshots: dict[int, _Snapshot] = {}
        self.plans: list[StepPlan] = []
        self.num_forward_tokens = 0  # tokens run through a (fake) forward pass
        self.num_restores = 0
        self.num_resumes = 0
        self._next_life = 0
        self.num_invalid = 0  # decode rows answered valid=False (finished on the device)

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        released = set(plan.released_rows)
        assert released <= self.live, "a row released twice, or never admitted"
        self.live -= released  # their entries stay, stale: nothing may use them now
        before = dict(self.table)  # a row leaving in this step is snapshotted with its old table
        for w in plan.page_table_writes:
            assert w.row != NULL_ROW and 0 <= w.index < self.config.max_pages_per_row
            if w.page_id == NO_PAGE:
                self.table.pop((w.row, w.index), None)
            else:
                assert 0 <= w.page_id < self.config.num_pages
                self.table[(w.row, w.index)] = w.page_id
        for op in plan.admits:
            assert op.row != NULL_ROW
            assert op.row not in self.live, "admitted into a row that is not free"
            self.live.add(op.row)
            self.rows[op.row] = _Row(self._next_life, op.request_id, op.prompt_token_ids, op.params)
            self._next_life += 1
        self._mapping: dict[int, set[int]] = {}  # page -> rows whose table maps it
        for (row, _), page in self.table.items():
            if row in self.live:
                self._mapping.setdefault(page, set()).add(row)
        admitted = {op.row for op in plan.admits}
        for rop in plan.restores:
            assert rop.row in admitted, "restore into a row not admitted in this step"
            self._restore(rop)
        used = set(plan.decode.rows if plan.decode is not None else ())
        used |= {plan.prefill.row} if plan.prefill is not None else set()
        used |= set(plan.resume.rows if plan.resume is not None else ())
        assert used <= self.live, f"rows {used - self.live} are executed but not admitted"
        resumed: list[SampledToken] = []
        if plan.resume is not None:
            for row, request_id in zip(plan.resume.rows, plan.resume.request_ids, strict=True):
                st = self.rows[row]
                assert st.request_id == request_id and st.restored and st.generated == 0
                assert st.consumed == len(st.prompt), "resume before the prompt is consumed"
                self.num_resumes += 1
                resumed.append(self._sample(row, st))
        decoded: list[SampledToken] = []
        if plan.decode is not None:
            rows = plan.decode.rows
            assert 0 < len(rows) <= self.config.max_decode_rows and len(set(rows)) == len(rows)
            for row, request_id in zip(rows, plan.decode.request_ids, strict=True):
                decoded.append(self._decode(row, request_id))
        prefilled = self._prefill(plan.prefill) if plan.prefill is not None else None
        for sop in plan.snapshots:
            self._snapshot(sop, before)
        return StepResult(plan.step_id, tuple(decoded), prefilled, resumed=tuple(resumed))

    def _copy_page(self, copy: PageCopy) -> None:
        size = self.config.page_size
        assert copy.src_page != copy.dst_page
        for off in range(size):
            src = copy.src_page * size + off
            dst = copy.dst_page * size + off
            if src in self.kv:
                self.kv[dst] = self.kv[src]
            else:
                self.kv.pop(dst, None)

    def _mapped_by(self, page: int) -> set[int]:
        return self._mapping.get(page, set())

    def _restore(self, op: RestoreOp) -> None:
        st = self.rows[op.row]
        assert st.request_id == op.request_id and st.consumed == 0
        snap = self.snapshots[op.snapshot]
        assert len(snap.history) == op.num_tokens <= len(st.prompt)
        assert snap.history == st.prompt[: op.num_tokens], "restored state of another prefix"
        size = self.config.page_size
        assert (op.tail_copy is not None) == (op.num_tokens % size != 0)
        if op.tail_copy is not None:
            dst = self.table.get((op.row, op.num_tokens // size))
            assert dst == op.tail_copy.dst_page, "tail copy into a page the row does not map"
            assert self._mapped_by(dst) == {op.row}, "tail copy into a shared page"
            self._copy_page(op.tail_copy)
        st.consumed = op.num_tokens
        st.digests = list(snap.digests)
        st.hidden = snap.hidden
        st.restored = True
        self.num_restores += 1
        self._check_history(op.row, st)

    def _snapshot(self, op: SnapshotOp, before: dict[tuple[int, int], int]) -> None:
        st = self.rows[op.row]
        assert st.request_id == op.request_id
        if self.config.recurrent_state:
            assert st.consumed == op.num_tokens, (
                f"snapshot at {op.num_tokens}, row at {st.consumed}"
            )
        else:  # inside a chunk: pages and count only
            assert op.num_tokens <= st.consumed, (
                f"snapshot at {op.num_tokens}, row at {st.consumed}"
            )
        leaving = op.row not in self.live  # released by this plan: its last snapshot
        self._check_history(op.row, st, before if leaving else None)
        history = tuple(st.token_at(p) for p in range(op.num_tokens))
        digests = tuple(st.digests[: op.num_tokens])
        self.snapshots[op.snapshot] = _Snapshot(history, digests, st.digests[-1])
        if op.tail_copy is not None:
            size = self.config.page_size
            assert op.num_tokens % size
            assert self.table.get((op.row, op.num_tokens // size)) == op.tail_copy.src_page
            assert not self._mapped_by(op.tail_copy.dst_page), "snapshot tail page is mapped"
            self._copy_page(op.tail_copy)

    def _write_kv(self, row: int, pos: int, digest: int) -> None:
        slot = self._slot(row, pos)
        mapped = self._mapped_by(slot // self.config.page_size)
        assert mapped == {row}, f"row {row} writes page {slot // self.config.page_size} of {mapped}"
        self.kv[slot] = (pos, digest)

    def _slot(self, row: int, pos: int, table: dict[tuple[int, int], int] | None = None) -> int:
        size = self.config.page_size
        page = (self.table if table is None else table).get((row, pos // size))
        assert page is not None, f"row {row}: no page mapped for position {pos}"
        return page * size + pos % size

    def _check_history(
        self, row: int, st: _Row, table: dict[tuple[int, int], int] | None = None
    ) -> None:
        for pos in range(st.consumed):
            got = self.kv.get(self._slot(row, pos, table))
            assert got == (pos, st.digests[pos]), f"row {row}: KV of position {pos} is wrong"

    def _decode(self, row: int, request_id: str) -> SampledToken:
        st = self.rows[row]
        assert st.request_id == request_id
        if st.finished:
            self.num_invalid += 1
            return SampledToken(request_id, row, 0, False, FinishReason.NONE)
        assert st.consumed == len(st.prompt) + st.generated - 1 >= len(st.prompt), "no pending"
        pos = st.consumed
        self._slot(row, pos + 1)  # growth rule: mapped one position ahead
        self._write_kv(row, pos, st.consume(pos))
        self.num_forward_tokens += 1
        self._check_history(row, st)
        return self._sample(row, st)

    def _prefill(self, op: PrefillOp) -> SampledToken | None:
        st = self.rows[op.row]
        assert st.request_id == op.request_id and not st.finished and st.generated == 0
        assert op.start_pos == st.consumed and len(op.token_ids) >= 1
        assert op.token_ids == st.prompt[op.start_pos : op.start_pos + len(op.token_ids)]
        assert len(op.slot_mapping) == len(op.token_ids)
        for i, slot in enumerate(op.slot_mapping):
            pos = op.start_pos + i
            assert slot == self._slot(op.row, pos), f"slot of position {pos}"
            self._write_kv(op.row, pos, st.consume(pos))
        self.num_forward_tokens += len(op.token_ids)
        self._check_history(op.row, st)
        assert op.sample == (st.consumed == len(st.prompt))
        return self._sample(op.row, st) if op.sample else None

    def _sample(self, row: int, st: _Row) -> SampledToken:
        if self.content_sampling:
            # a full-prompt hit's first sample comes from the restored hidden vector
            hidden = st.digests[-1] if st.hidden is None else st.hidden
            token = content_token(st.params.seed, st.generated, hidden, self.vocab_size)
        else:
            token = token_for(st.params.seed, st.generated, self.vocab_size)
        st.generated += 1
        st.outputs.append(token)
        reason = FinishReason.NONE
        past_min = st.generated > st.params.min_tokens
        if not self.enforce_limits:
            pass
        elif token == self.eos_token_id and not st.params.ignore_eos and past_min:
            reason = FinishReason.EOS
        elif token in st.params.stop_token_ids and past_min:
            reason = FinishReason.STOP_TOKEN
        elif st.generated >= st.params.max_tokens:
            reason = FinishReason.LENGTH
        elif len(st.prompt) + st.generated >= self.config.max_context_tokens:
            reason = FinishReason.CAPACITY
        st.finished = reason is not FinishReason.NONE
        return SampledToken(st.request_id, row, token, True, reason)


@dataclass
class Transcript:
    """Events grouped per request id, checked for stream shape as they are added."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finishes: dict[str, FinishEvent] = field(default_factory=dict)

    def add(self, events: list[EngineEvent]) -> None:
        for ev in events:
            assert ev.request_id not in self.finishes, f"event after finish: {ev}"
            if isinstance(ev, TokenEvent):
                self.tokens.setdefault(ev.request_id, []).extend(t.token_id for t in ev.tokens)
            else:
                self.finishes[ev.request_id] = ev
                assert ev.completion_tokens == len(self.tokens.get(ev.request_id, []))


def drive(
    sched: Scheduler,
    device: FakeDevice,
    *,
    depth: int = 1,
    transcript: Transcript | None = None,
    pending: deque[StepResult] | None = None,
    max_iterations: int = 100_000,
) -> Transcript:
    """Run until idle, keeping up to `depth` steps in flight; check integrity after each call.

    `pending`: results of steps already planned and executed but not yet completed.
    """
    transcript = Transcript() if transcript is None else transcript
    pending = deque() if pending is None else pending
    for _ in range(max_iterations):
        if len(pending) < depth and sched.has_work():
            pending.append(device.execute(sched.plan()))
        elif pending:
            transcript.add(sched.complete(pending.popleft()))
        else:
            return transcript
        sched.check_integrity()
    raise AssertionError("the scheduler did not drain")


def assert_drained(sched: Scheduler, device: FakeDevice) -> None:
    sched.reset_prefix_cache()
    sched.check_integrity()
    stats = sched.stats()
    assert stats["snapshots_used"] == 0 and stats["checkpoints"] == 0
    assert sched.num_in_flight == 0 and not sched.has_work()
    assert stats["pages_free"] == stats["pages_total"]
    assert stats["state_rows_free"] == stats["state_rows_total"]
    assert stats["requests_running"] == stats["requests_waiting"] == 0
    # every row is free; its stale page-table entries are rewritten at its next admission
    assert device.live <= set(sched._resources.take_released()), "a row was never released"
