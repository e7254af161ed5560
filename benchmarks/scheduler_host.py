"""Host cost of the scheduler at agent turn boundaries, without a model or a device.

    python benchmarks/scheduler_host.py [--page-size 16] [--num-pages 600000] [--repeat 5]
                                        [--out F.jsonl]

Drives `Scheduler` alone (pure Python, no torch) through the cached agent trace of
`agent_trace.Trace` (system prompt 2,048, tool results of 300 tokens, 40 generated per turn, two
branches) with a device stand-in that answers every plan at once: each decode or sampling
prefill returns one token and the stand-in ends a row at its max_tokens as the device does. The
pool sizes default to the H200 engine serving a 9B hybrid (page 16, ~600k pages, one row).

Every plan is timed (perf_counter) and classified like `turn_boundary.py`: `capture` (a finished
turn's terminal checkpoint), `admit` (the next turn: lookup, restore, its first chunk),
`decode`, `other` (prefill only); `complete` and `submit` are timed too. Prints one JSON line per kind with
median and p90 in microseconds over turns 3..10 of every repeat, and per kind the page-table
entries its plans write (`KIND_page_writes`: the runner stages and uploads each). These are the host
milliseconds on the critical path between one agent turn's end and the next one's first
token, which the turn-10 speedup target is most sensitive to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.agent_trace import Trace
from benchmarks.turn_boundary import plan_kind
from flared.engine.events import TokenEvent
from flared.engine.plan import FinishReason, RequestParams, SampledToken, StepPlan, StepResult
from flared.engine.scheduler import Scheduler, SchedulerConfig


class Device:
    """Answers plans at once: one token per sampling row, LENGTH at the row's max_tokens."""

    def __init__(self) -> None:
        self.left: dict[int, int] = {}  # row -> tokens it may still generate

    def _sample(self, row: int, request_id: str) -> SampledToken:
        left = self.left.get(row, 0)
        if left <= 0:
            return SampledToken(request_id, row, 0, False, FinishReason.NONE)
        self.left[row] = left - 1
        reason = FinishReason.LENGTH if left == 1 else FinishReason.NONE
        return SampledToken(request_id, row, 7 + left, True, reason)

    def execute(self, plan: StepPlan) -> StepResult:
        for op in plan.admits:
            self.left[op.row] = op.params.max_tokens
        decoded = ()
        if plan.decode is not None:
            decoded = tuple(
                self._sample(r, i) for r, i in zip(plan.decode.rows, plan.decode.request_ids)
            )
        prefilled = None
        if plan.prefill is not None and plan.prefill.sample:
            prefilled = self._sample(plan.prefill.row, plan.prefill.request_id)
        resumed = ()
        if plan.resume is not None:
            resumed = tuple(
                self._sample(r, i) for r, i in zip(plan.resume.rows, plan.resume.request_ids)
            )
        return StepResult(plan.step_id, decoded, prefilled, resumed=resumed)


def run(args: argparse.Namespace, salt: int) -> dict[str, list[tuple[str, float]]]:
    """Kind -> [(request, seconds)] of every timed call of one conversation."""
    sched = Scheduler(
        SchedulerConfig(
            num_pages=args.num_pages, page_size=args.page_size, max_num_rows=args.rows,
            decode_capacities=(1,), max_prefill_chunk_tokens=4096, max_context_tokens=16384,
            max_num_waiting=64, num_snapshot_rows=args.snapshot_rows, model_id="bench",
            token_layout="bench", recurrent_state=True, min_capture_gap=64,
        )
    )  # fmt: skip
    dev = Device()
    times: dict[str, list[tuple[str, float]]] = {}

    def note(kind: str, name: str, dt: float) -> None:
        times.setdefault(kind, []).append((name, dt))

    def serve(name: str, prompt: list[int], ends: tuple[int, ...]) -> list[int]:
        params = RequestParams(max_tokens=Trace.CALL, ignore_eos=True, seed=salt)
        t = time.perf_counter()
        sched.submit(name, prompt, params, ends)
        note("submit", name, time.perf_counter() - t)
        out: list[int] = []
        done = False
        while not done:
            t = time.perf_counter()
            plan = sched.plan()
            note(plan_kind(plan), name, time.perf_counter() - t)
            note(f"{plan_kind(plan)}_page_writes", name, len(plan.page_table_writes))
            result = dev.execute(plan)
            t = time.perf_counter()
            events = sched.complete(result)
            note("complete", name, time.perf_counter() - t)
            for ev in events:
                if ev.request_id != name:
                    continue
                if isinstance(ev, TokenEvent):
                    out += [tok.token_id for tok in ev.tokens]
                else:
                    done = True
        return out

    Trace(2048, 300, 50_000, salt).run(serve)
    while sched.has_work() or sched.num_in_flight:  # the last turn's terminal capture
        plan = sched.plan()
        t = time.perf_counter()
        sched.complete(dev.execute(plan))
        note("complete", "tail", time.perf_counter() - t)
    sched.check_integrity()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--num-pages", type=int, default=600_000)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--snapshot-rows", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    turns = {f"turn{t}" for t in range(3, Trace.TURNS + 1)}
    merged: dict[str, list[float]] = {}
    for salt in range(1, args.repeat + 1):
        for kind, vals in run(args, salt).items():
            merged.setdefault(kind, []).extend(dt for name, dt in vals if name in turns)
    recs = []
    for kind, vals in sorted(merged.items()):
        vals.sort()
        if kind.endswith("_page_writes"):
            recs.append({"kind": "scheduler_host", "call": kind, "n": len(vals),
                         "median": statistics.median(vals), "max": vals[-1]})  # fmt: skip
            continue
        recs.append({
            "kind": "scheduler_host", "call": kind, "n": len(vals),
            "median_us": 1e6 * statistics.median(vals),
            "p90_us": 1e6 * vals[int(0.9 * (len(vals) - 1))],
            "page_size": args.page_size, "num_pages": args.num_pages,
        })  # fmt: skip
    for rec in recs:
        print(json.dumps(rec))
    jsonl.append(args.out, recs)


if __name__ == "__main__":
    main()
