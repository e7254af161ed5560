"""Turn a StepPlan into staged uploads and replays, and completion records into a StepResult.

Host work per step: fill pinned staging buffers, enqueue H2D copies and replays on the model
stream, enqueue D2H copies of the completion records into pinned buffers, and record one event.
`wait()` blocks on that event only. With two steps in flight the host prepares step N+1 while
the device runs step N; the decode execution reads the token sampled by step N from device
request state, so nothing waits on the host between them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flared.engine.plan import (
    NULL_ROW,
    AdmitOp,
    FinishReason,
    PageCopy,
    PrefillOp,
    SampledToken,
    StepPlan,
    StepResult,
    write_columns,
)
from prep.calls import FINAL_SAMPLE, FRESH_SUFFIX, LEAN_SUFFIX, SINGLE_SUFFIX, fresh_chunk_min
from prep.components.sampling import takes_candidates
from prep.executions import FLOAT_PARAMS, Completion

if TYPE_CHECKING:
    from flared.runner.prepared import PreparedCall
    from flared.runner.runner import ModelRunner

_EVENT_PAIRS = 8  # > steps in flight + 1


@dataclass
class _Pending:
    plan: StepPlan
    event: Any
    start_event: Any = None
    decode: tuple[str, Completion] | None = None
    prefill: Completion | None = None
    resume: Completion | None = None
    submitted_at: float = 0.0
    host_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def _stage_padded(host: np.ndarray, values: Any, pad: int) -> None:
    """host[:len(values)] = values, the rest = pad, in a numpy view of a host staging buffer
    (pinned on CUDA), without a temporary tensor per column."""
    n = len(values)
    if n > 64 and isinstance(values, (tuple, list)):
        # numpy's sequence conversion inspects every element; fromiter only converts them
        # (a 5,000-token prompt: 0.07 ms instead of 0.14)
        host[:n] = np.fromiter(values, dtype=host.dtype, count=n)
    else:
        host[:n] = values
    host[n:] = pad


class StepBuilder:
    def __init__(self, runner: ModelRunner) -> None:
        self.r = runner
        cat = runner.manifest.catalog
        self.decode_caps = sorted(cat.decode_capacities)
        self.prefill_caps = sorted(cat.prefill_capacities)
        self.cuda = runner.device.type == "cuda"
        # two pinned host completion sets per execution, used alternately
        self._host: dict[str, list[Completion]] = {
            name: [
                Completion.allocate(c.token.shape[0], c.top_ids.shape[1], torch.device("cpu"), self.cuda)
                for _ in range(2)
            ]
            for name, c in runner.completions.items()
        }  # fmt: skip
        self._flip: dict[str, int] = dict.fromkeys(self._host, 0)
        self.logprobs_by_row: dict[int, int] = {}
        # rows whose sampling takes the candidate path (sampling.takes_candidates): a batch
        # of only those runs decode{b}_lean, which skips the sort over the vocabulary
        self.candidate_rows: set[int] = set()
        # rows whose request did not ask for a reproducible draw (RequestParams.reproducible
        # False): a step of one such row alone runs decode1{,_lean}_single where the runner
        # built them (`decode_single_gemm`); every other step the batch-invariant executions
        self.unseeded_rows: set[int] = set()
        self.single_row = f"decode1{SINGLE_SUFFIX}" in runner.calls
        # decode steps run by each decode execution (engine stats: which paths serve), keys
        # fixed here so that another thread may copy the dict while this one counts
        self.decode_runs: dict[str, int] = dict.fromkeys(
            (name for name in runner.calls if name.startswith("decode")), 0
        )
        # prefill chunks run by each prefill execution (prefill{C}_fresh: chunks that start
        # their prompt and attend over their own keys, where the runner built them)
        self.prefill_runs: dict[str, int] = dict.fromkeys(
            (name for name in runner.calls if name.startswith("prefill")), 0
        )
        # samples drawn without a forward pass by each execution: resume{b}{,_lean} (rows
        # restored from a full-prompt checkpoint) and final_sample{,_lean} (the first token
        # after a prompt's last prefill chunk); _lean where every row takes its candidates
        self.sample_runs: dict[str, int] = dict.fromkeys(
            (name for name in runner.calls if name.startswith(("resume", FINAL_SAMPLE))), 0
        )
        # Partial uploads. Prompt inputs (last in their call's packed buffer): prompt entries
        # [0, extent) of the device buffer may hold tokens, the rest is -1, so an upload need
        # only reach max(new length, extent). Masks (last too): whether the device mask holds
        # all ones, so an unconstrained step need not upload it again.
        for name, call in runner.calls.items():
            last = list(call.inputs)[-1]
            for key in ("prompt", "mask"):
                if key in call.inputs and last != key:
                    raise ValueError(f"call {name}: {key!r} must be its last input, not {last!r}")
        self._prompt_extent: dict[str, int] = {
            name: call.inputs["prompt"].shape[0]
            for name, call in runner.calls.items() if "prompt" in call.inputs
        }  # fmt: skip
        self._mask_clear: dict[str, bool] = dict.fromkeys(
            (name for name, call in runner.calls.items() if "mask" in call.inputs), True
        )
        self._last_end: Any = None  # end event of the previously waited step (CUDA)
        # (start, end) timing events of steps, reused round-robin: a step's pair is re-recorded
        # only after that step and the next were waited for (at most MAX_STEPS_IN_FLIGHT steps
        # are in flight, and `_last_end` is the previous one's end)
        self._step_events: list[tuple[Any, Any]] = []
        self._next_events = 0
        wait = runner.plan.step_wait  # "spin" | "block", checked by plan_runner
        if self.cuda:
            # the end event is the one waited on: "block" makes its wait a sleep in the driver
            # (cudaEventBlockingSync) instead of a poll that keeps the engine thread's core busy
            self._step_events = [
                (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True, blocking=wait == "block"),
                )
                for _ in range(_EVENT_PAIRS)
            ]
            self._raw_stream = runner.stream.cuda_stream
            self._device_index = runner.device.index or 0

    def _use_model_stream(self) -> None:
        """Make the model stream this thread's current one (uploads, replays and completion
        copies are issued on the current stream). Comparing the raw stream handle costs far
        less than entering and leaving a stream context on every step; the stream stays
        current for the thread afterwards."""
        if torch._C._cuda_getCurrentRawStream(self._device_index) != self._raw_stream:
            torch.cuda.set_stream(self.r.stream)

    # -- submission --------------------------------------------------------------------------
    def submit(self, plan: StepPlan, masks: dict[int, torch.Tensor] | None = None) -> _Pending:
        """masks: request row -> int32 [ceil(V/32)] grammar bitmask for this step's sample."""
        t0 = time.perf_counter()
        pending = _Pending(plan=plan, event=None, submitted_at=t0)
        events: tuple[Any, Any] | None = None
        if self.cuda:
            self._use_model_stream()
            events = self._step_events[self._next_events]
            self._next_events = (self._next_events + 1) % len(self._step_events)
        if events is not None and not plan.is_empty:
            pending.start_event = events[0]
            pending.start_event.record(self.r.stream)
        whole = self._admits_alone(plan)
        if whole:
            self._admission(plan)
        else:
            self._page_writes(plan)
            for op in plan.admits:
                self._admit(op)
        if plan.restores and not whole:
            self._run_chunked(
                "state_restore",
                {"src": [self._snapshot_row(op.snapshot) for op in plan.restores],
                 "dst": [op.row for op in plan.restores]},
                {"src": NULL_ROW, "dst": NULL_ROW},
            )  # fmt: skip
            self._copy_pages([op.tail_copy for op in plan.restores if op.tail_copy])
        if plan.resume is not None and plan.resume.rows:
            pending.resume = self._resume(plan.resume.rows, masks)
        if plan.decode is not None and plan.decode.rows:
            pending.decode = self._decode(plan.decode.rows, masks)
        if plan.prefill is not None:
            pending.prefill = self._prefill(plan.prefill, masks)
        if plan.snapshots and self._captures_at_once(plan):
            self._capture(plan)
        elif plan.snapshots:
            self._run_chunked(
                "state_snapshot",
                {"src": [op.row for op in plan.snapshots],
                 "dst": [self._snapshot_row(op.snapshot) for op in plan.snapshots],
                 "consumed": [op.num_tokens for op in plan.snapshots]},
                {"src": NULL_ROW, "dst": NULL_ROW, "consumed": 0},
            )  # fmt: skip
            self._copy_pages([op.tail_copy for op in plan.snapshots if op.tail_copy])
        if events is not None:
            events[1].record(self.r.stream)
            pending.event = events[1]
        pending.host_s = time.perf_counter() - t0
        return pending

    def _page_writes(self, plan: StepPlan) -> None:
        if not plan.page_table_writes:
            return
        rows, index, pages = write_columns(plan.page_table_writes)
        self._run_chunked(
            "pages", {"rows": rows, "index": index, "pages": pages},
            {"rows": NULL_ROW, "index": 0, "pages": -1},
        )  # fmt: skip

    def _run_chunked(
        self, name: str, columns: dict[str, Sequence[int]], pad: dict[str, int]
    ) -> None:
        """Replay the static call `name` over equal-length index columns, in chunks of its
        capacity; the unused tail of each input holds `pad[column]`."""
        call = self.r.calls[name]
        n = len(next(iter(columns.values())))
        cap = call.inputs[next(iter(columns))].shape[0]
        for start in range(0, n, cap):
            st = call.stage_arrays()
            for key, values in columns.items():
                part = values[start : start + cap]
                _stage_padded(st[key], part, pad[key])
            call.upload(self.r.stream)
            call.run()

    # -- checkpoints ----------------------------------------------------------------------------
    def _snapshot_row(self, snapshot: int) -> int:
        pool = self.r.pool
        if pool is None or not 0 <= snapshot < pool.num_snapshot_rows:
            raise ValueError(f"snapshot {snapshot} is outside the state pool")
        return pool.first_snapshot_row + snapshot

    def _copy_pages(self, copies: list[PageCopy | None]) -> None:
        todo = [c for c in copies if c is not None]
        trash = self.r.kv.trash_page
        self._run_chunked(
            "copy_pages", {"src": [c.src_page for c in todo], "dst": [c.dst_page for c in todo]},
            {"src": trash, "dst": trash},
        )  # fmt: skip

    def _capacity(self, caps: list[int], n: int, what: str) -> int:
        """The smallest prepared capacity holding n, or ValueError naming `what`."""
        i = bisect.bisect_left(caps, n)
        if i == len(caps):
            raise ValueError(f"{what} of {n} exceeds the prepared capacities")
        return caps[i]

    def _resume(
        self, rows: tuple[int, ...], masks: dict[int, torch.Tensor] | None = None,
        name: str | None = None,
    ) -> Completion:  # fmt: skip
        """Sample rows' next tokens from their saved hidden vectors: resume{b} or, with `name`
        (FINAL_SAMPLE, one row), the sample after a prompt's last chunk; the _lean execution
        where every row samples from its candidates."""
        if name is None:
            name = f"resume{self._capacity(self.decode_caps, len(rows), 'resume batch')}"
        if self.candidate_rows.issuperset(rows) and name + LEAN_SUFFIX in self.r.calls:
            name += LEAN_SUFFIX
        self.sample_runs[name] += 1
        call = self.r.calls[name]
        st = call.stage_arrays()
        _stage_padded(st["rows"], rows, NULL_ROW)
        self._upload_masked(call, st, rows, masks)
        call.run()
        return self._fetch(name)

    def _captures_at_once(self, plan: StepPlan) -> bool:
        """Whether the step's snapshots and their tail-page copies fit one `capture` call."""
        call = self.r.calls.get("capture")
        if call is None:
            return False
        cap = min(call.inputs["src"].shape[0], call.inputs["copy_src"].shape[0])
        return len(plan.snapshots) <= cap

    def _capture(self, plan: StepPlan) -> None:
        """Snapshots, then their tail-page copies: one upload, one replay."""
        call = self.r.calls["capture"]
        st = call.stage_arrays()
        snaps = plan.snapshots
        copies = [op.tail_copy for op in snaps if op.tail_copy is not None]
        trash = self.r.kv.trash_page
        _stage_padded(st["src"], [op.row for op in snaps], NULL_ROW)
        _stage_padded(st["dst"], [self._snapshot_row(op.snapshot) for op in snaps], NULL_ROW)
        _stage_padded(st["consumed"], [op.num_tokens for op in snaps], 0)
        _stage_padded(st["copy_src"], [c.src_page for c in copies], trash)
        _stage_padded(st["copy_dst"], [c.dst_page for c in copies], trash)
        call.upload(self.r.stream)
        call.run()

    def _admits_alone(self, plan: StepPlan) -> bool:
        """Whether the step's page writes, admit, restore and tail copy fit the `admission`
        call: one admit, at most one restore (into that row) and its page writes."""
        if len(plan.admits) != 1 or len(plan.restores) > 1 or "admission" not in self.r.calls:
            return False
        if plan.restores and plan.restores[0].row != plan.admits[0].row:
            return False
        cap = self.r.calls["admission"].inputs["write_rows"].shape[0]
        return len(plan.page_table_writes) <= cap

    def _admission(self, plan: StepPlan) -> None:
        """Page writes, admit, state init or restore, tail copy: one upload, one replay."""
        call = self.r.calls["admission"]
        st = call.stage_arrays()
        (op,) = plan.admits
        self._stage_admit(st, op)
        rows, index, pages = write_columns(plan.page_table_writes)
        _stage_padded(st["write_rows"], rows, NULL_ROW)
        _stage_padded(st["write_index"], index, 0)
        _stage_padded(st["write_pages"], pages, -1)
        trash = self.r.kv.trash_page
        restore = plan.restores[0] if plan.restores else None
        copy = restore.tail_copy if restore is not None else None
        st["init_row"][0] = NULL_ROW if restore is not None else op.row
        st["restore_src"][0] = self._snapshot_row(restore.snapshot) if restore else NULL_ROW
        st["restore_dst"][0] = restore.row if restore is not None else NULL_ROW
        st["copy_src"][0] = copy.src_page if copy is not None else trash
        st["copy_dst"][0] = copy.dst_page if copy is not None else trash
        call.upload(self.r.stream, self._prompt_upto(call, len(op.prompt_token_ids)))
        call.run()

    def _admit(self, op: AdmitOp) -> None:
        call = self.r.calls["admit"]
        st = call.stage_arrays()
        self._stage_admit(st, op)
        call.upload(self.r.stream, self._prompt_upto(call, len(op.prompt_token_ids)))
        call.run()

    def _prompt_upto(self, call: PreparedCall, n: int) -> int:
        """Bytes to upload for a staged prompt of n tokens (see `_prompt_extent`)."""
        upto = call.offset("prompt", max(n, self._prompt_extent[call.name]))
        self._prompt_extent[call.name] = n
        return upto

    def _stage_admit(self, st: dict[str, np.ndarray], op: AdmitOp) -> None:
        p = op.params
        st["row"][0] = op.row
        prompt = st["prompt"]
        n = len(op.prompt_token_ids)
        if n > prompt.shape[0]:
            raise ValueError(f"prompt of {n} tokens exceeds the prepared context limit")
        if op.prompt_packed is not None and len(op.prompt_packed) == 8 * n:
            prompt[:n] = np.frombuffer(op.prompt_packed, dtype="<i8")  # one copy
            prompt[n:] = -1
        else:
            _stage_padded(prompt, op.prompt_token_ids, -1)
        st["fparams"][:] = [float(getattr(p, f)) for f in FLOAT_PARAMS]
        st["iparams"][:] = [
            p.top_k, _to_i64(p.seed), p.max_tokens, p.min_tokens, int(p.ignore_eos),
            p.logprobs,
        ]  # fmt: skip
        stop = st["stop_ids"]
        if len(p.stop_token_ids) > stop.shape[0]:
            raise ValueError(f"more than {stop.shape[0]} stop token ids")
        _stage_padded(stop, p.stop_token_ids, -1)
        self.logprobs_by_row[op.row] = p.logprobs
        if takes_candidates(p.top_k):
            self.candidate_rows.add(op.row)
        else:
            self.candidate_rows.discard(op.row)
        if p.reproducible:
            self.unseeded_rows.discard(op.row)
        else:
            self.unseeded_rows.add(op.row)

    def _upload_masked(
        self, call: PreparedCall, st: dict[str, np.ndarray], rows: tuple[int, ...],
        masks: dict[int, torch.Tensor] | None,
    ) -> None:  # fmt: skip
        """Stage the rows' token masks (all ones where unconstrained) and upload the call;
        the mask (its last input) only when the device does not hold all ones already."""
        buf = st["mask"]
        buf.fill(-1)  # every word all ones: unconstrained
        constrained = False
        for j, row in enumerate(rows):
            if masks and row in masks:
                buf[j] = masks[row].numpy()
                constrained = True
        clear = self._mask_clear[call.name]
        self._mask_clear[call.name] = not constrained
        call.upload(self.r.stream, call.offset("mask") if clear and not constrained else None)

    def _decode(
        self, rows: tuple[int, ...], masks: dict[int, torch.Tensor] | None = None
    ) -> tuple[str, Completion]:
        name = f"decode{self._capacity(self.decode_caps, len(rows), 'decode batch')}"
        if self.candidate_rows.issuperset(rows):  # no row needs the sorted vocabulary
            name += LEAN_SUFFIX
        if self.single_row and len(rows) == 1 and rows[0] in self.unseeded_rows:
            name += SINGLE_SUFFIX  # decode1 is the smallest capacity where decode1_single exists
        self.decode_runs[name] += 1
        call = self.r.calls[name]
        st = call.stage_arrays()
        _stage_padded(st["rows"], rows, NULL_ROW)
        self._upload_masked(call, st, rows, masks)
        call.run()
        return name, self._fetch(name)

    def _prefill(
        self, op: PrefillOp, masks: dict[int, torch.Tensor] | None = None
    ) -> Completion | None:
        """The chunk, then, where it ends its prompt, the sample from its last token's hidden
        vector (the prefill execution samples nothing: prep.executions.Executions.prefill)."""
        n = len(op.token_ids)
        cap = self._capacity(self.prefill_caps, n, "prefill chunk")
        name = f"prefill{cap}"
        # a chunk that starts its prompt attends over its own keys only (where built)
        if op.start_pos == 0 and n >= fresh_chunk_min(cap) and name + FRESH_SUFFIX in self.r.calls:
            name += FRESH_SUFFIX
        self.prefill_runs[name] += 1
        call = self.r.calls[name]
        st = call.stage_arrays()
        _stage_padded(st["tokens"], op.token_ids, 0)
        positions = st["positions"]
        positions[:n] = np.arange(op.start_pos, op.start_pos + n)
        positions[n:] = 0
        _stage_padded(st["slots"], op.slot_mapping, -1)
        st["row"][0] = op.row
        st["num_valid"][0] = n
        call.upload(self.r.stream)
        call.run()
        return self._resume((op.row,), masks, FINAL_SAMPLE) if op.sample else None

    def _fetch(self, name: str) -> Completion:
        """Enqueue the D2H copy of a completion record into the next pinned host set."""
        i = self._flip[name]
        self._flip[name] = 1 - i
        host = self._host[name][i]
        host.copy_from(self.r.completions[name], non_blocking=self.cuda)
        return host

    # -- completion --------------------------------------------------------------------------
    def wait(self, pending: _Pending) -> StepResult:
        extra = {"host_s": pending.host_s}
        if pending.event is not None:
            pending.event.synchronize()
            if pending.start_event is not None:
                # host submission gap: device idle between the previous step's end and this
                # step's start (zero when the host kept the queue ahead of the device)
                if self._last_end is not None:
                    extra["gap_ms"] = max(0.0, self._last_end.elapsed_time(pending.start_event))
                extra["device_ms"] = pending.start_event.elapsed_time(pending.event)
                self._last_end = pending.event
        plan = pending.plan
        decoded: tuple[SampledToken, ...] = ()
        if pending.decode is not None and plan.decode is not None:
            _, comp = pending.decode
            decoded = self._tokens(comp, plan.decode.rows, plan.decode.request_ids)
        prefilled = None
        if pending.prefill is not None and plan.prefill is not None and plan.prefill.sample:
            (prefilled,) = self._tokens(
                pending.prefill, (plan.prefill.row,), (plan.prefill.request_id,)
            )
        resumed: tuple[SampledToken, ...] = ()
        if pending.resume is not None and plan.resume is not None:
            resumed = self._tokens(pending.resume, plan.resume.rows, plan.resume.request_ids)
        return StepResult(
            step_id=plan.step_id,
            decoded=decoded,
            prefilled=prefilled,
            resumed=resumed,
            extra={**extra, "step_s": time.perf_counter() - pending.submitted_at},
        )

    def _tokens(
        self, comp: Completion, rows: Sequence[int], request_ids: Sequence[str]
    ) -> tuple[SampledToken, ...]:
        """The sampled tokens of a completion record's first len(rows) entries. Read through
        numpy views of the host record: a torch call per field and row would release and retake
        the GIL each time, and another busy Python thread makes each retake wait."""
        n = len(rows)
        token = comp.token.numpy()[:n].tolist()
        valid = comp.valid.numpy()[:n].tolist()
        reason = comp.reason.numpy()[:n].tolist()
        logprob = comp.logprob.numpy()[:n].tolist()
        out = []
        for j in range(n):
            k = self.logprobs_by_row.get(rows[j], 0)
            top: tuple[tuple[int, float], ...] = ()
            if k:
                ids = comp.top_ids.numpy()[j, :k].tolist()
                lps = comp.top_logprobs.numpy()[j, :k].tolist()
                top = tuple(zip(ids, lps))
            out.append(
                SampledToken(
                    request_id=request_ids[j],
                    row=rows[j],
                    token_id=token[j],
                    valid=bool(valid[j]),
                    finish_reason=FinishReason(reason[j]),
                    logprob=logprob[j],
                    top_logprobs=top,
                )
            )
        return tuple(out)


def _to_i64(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= (1 << 63) else seed
