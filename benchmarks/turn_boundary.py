"""Where an agent turn's host time goes: a timeline of every turn boundary of the agent trace.

    python benchmarks/turn_boundary.py --bundle BUNDLE [--device cuda] [--out F.jsonl]

Runs the cached half of `agent_trace.Trace` through the in-process engine, timestamping the
engine thread's scheduler plans, runner submits and waits, event dispatches and stats refreshes,
and the client thread's submit, first token and finish. For each turn t >= 2 it reports, from
the moment turn t-1's finish reached the client (all in ms):

    capture_plan / capture_submit  the step that captures turn t-1's terminal checkpoint
    submit_to_admitted             client submit -> the engine took the request (its TTFT clock)
    admit_plan / admit_submit      the step that restores the checkpoint and prefills the turn
    first_token_engine             client submit -> the engine dispatched the first token
    first_token_client             client submit -> the client thread had it (the trace's TTFT)
    first_token_handoff            the engine's dispatch of that token -> the client had it

and the medians over turns 3..10 (turn 2 still warms the digest reuse). Prints JSON lines and a
table. `--profile N` also runs every capture and admit plan and submit under cProfile and
prints, per kind, the N functions of most internal time (one `turn_boundary_profile` record
each; profiling slows those calls, so their timeline columns are then not comparable). On CUDA
a submit only enqueues; on CPU it runs the executions, so there the submit columns are
execution time. Last, with the engine stopped, the last capture and admit plans are submitted
again 20 times (`turn_boundary_submit_alone`: the runner's host ms with no other thread).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.agent_trace import Trace, dispatch_yield

COLUMNS = (
    "capture_plan", "capture_submit", "submit_to_admitted", "admit_plan", "admit_submit",
    "first_token_engine", "first_token_client", "first_token_handoff",
)  # fmt: skip


def plan_kind(plan) -> str:
    if plan is None or plan.is_empty:
        return "empty"
    if plan.admits:
        return "admit"
    if plan.snapshots and plan.decode is None and plan.prefill is None:
        return "capture"
    return "decode" if plan.decode is not None else "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--gil-switch-ms", type=float, default=0.2)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument(
        "--dispatch-yield-us",
        type=float,
        default=None,
        help="EngineConfig.dispatch_yield_s in µs (default: the engine's; < 0: off)",
    )
    ap.add_argument(
        "--first-token-yield-us",
        type=float,
        default=None,
        help="EngineConfig.first_token_yield_s in µs (default: the engine's; < 0: off)",
    )
    ap.add_argument("--label", help="a tag added to every JSON line (e.g. the variant)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from flared.engine.events import FinishEvent, TokenEvent
    from flared.llm_engine import Engine, EngineConfig
    from flared.requests import SamplingParams

    eng = Engine(
        args.bundle,
        EngineConfig(
            device=args.device,
            gil_switch_interval_s=args.gil_switch_ms / 1e3,
            **dispatch_yield(args),
        ),
    ).start()
    log: list[tuple[float, float, str, str]] = []  # (start, end, what, detail)
    profiles: dict[str, list[cProfile.Profile]] = {}
    last_plans: dict[str, object] = {}  # kind -> the last capture / admit plan submitted

    def wrap(obj, name: str, what: str) -> None:
        orig = getattr(obj, name)

        def timed(*a, **k):
            prof = cProfile.Profile() if args.profile and what in ("plan", "submit") else None
            t = time.perf_counter()
            if prof is not None:
                prof.enable()
            out = orig(*a, **k)
            if prof is not None:
                prof.disable()
            if what == "dispatch":  # the requests a token event went to
                detail = " ".join(e.request_id for e in a[0] if isinstance(e, TokenEvent))
            else:
                detail = (
                    plan_kind(out) if what == "plan"
                    else plan_kind(a[0]) if what == "submit" else ""
                )  # fmt: skip
            log.append((t, time.perf_counter(), what, detail))
            if what == "submit" and detail in ("capture", "admit"):
                last_plans[detail] = a[0]
            if prof is not None and detail in ("capture", "admit"):
                profiles.setdefault(f"{detail}_{what}", []).append(prof)
            return out

        setattr(obj, name, timed)

    wrap(eng.scheduler, "plan", "plan")
    wrap(eng.runner, "submit", "submit")
    wrap(eng.scheduler, "submit", "admitted")
    wrap(eng, "_dispatch", "dispatch")

    def serve(name: str, prompt: list[int], ends: tuple[int, ...]) -> list[int]:
        t0 = time.perf_counter()
        log.append((t0, t0, "client_submit", name))
        out: list[int] = []
        first = False
        sampling = SamplingParams(temperature=1.0, seed=1)
        stream = eng.stream(prompt, max_tokens=Trace.CALL, ignore_eos=True, endpoints=ends,
                            sampling=sampling, request_id=name)  # fmt: skip
        for ev in stream:
            now = time.perf_counter()
            if isinstance(ev, TokenEvent):
                if not first:
                    first = True
                    log.append((now, now, "client_first", name))
                out += [t.token_id for t in ev.tokens]
            elif isinstance(ev, FinishEvent):
                log.append((now, now, "client_finish", name))
        return out

    Trace(2048, 300, eng.manifest.geometry.vocab_size, 1).run(serve)
    eng.shutdown()
    # The same submissions once more with the engine stopped: no other thread runs, so this
    # is the runner's own host cost of each (the timeline's submit columns add contention).
    alone = {"kind": "turn_boundary_submit_alone", "repeats": 20}
    parts: dict[str, list[float]] = {}  # "kind/part" -> ms of every repeat
    current = [""]

    def part(obj, name: str, label) -> None:
        orig = getattr(obj, name)

        def timed(self_or_first=None, *a, **k):
            t = time.perf_counter()
            try:
                if self_or_first is None:
                    return orig()
                return orig(self_or_first, *a, **k)
            finally:
                key = f"{current[0]}/{label(self_or_first)}.{name}"
                parts.setdefault(key, []).append(1e3 * (time.perf_counter() - t))

        setattr(obj, name, timed)

    from flared.runner.prepared import PreparedCall

    for meth in ("stage", "upload", "run"):
        part(PreparedCall, meth, lambda call: call.name)
    steps = eng.runner.steps
    for meth in (
        "_page_writes",
        "_admission",
        "_admit",
        "_prefill",
        "_fetch",
        "_copy_pages",
        "_capture",
    ):
        part(steps, meth, lambda _a: "steps")
    for kind, plan in sorted(last_plans.items()):
        current[0] = kind
        host = []
        for _ in range(20):
            t = time.perf_counter()
            pending = eng.runner.submit(plan)
            host.append(1e3 * (time.perf_counter() - t))
            eng.runner.wait(pending)
        alone[f"{kind}_submit"] = statistics.median(host)
    # per part: the summed ms of one submit (median over repeats of the per-submit sums)
    alone["parts_ms_per_submit"] = {key: round(sum(v) / 20, 4) for key, v in sorted(parts.items())}
    print(json.dumps(alone))

    def at(what: str, detail: str) -> int:
        return next(i for i, e in enumerate(log) if e[2] == what and e[3] == detail)

    rows = []
    for t in range(2, Trace.TURNS + 1):
        fin = log[at("client_finish", f"turn{t - 1}")][0]
        sub_i = at("client_submit", f"turn{t}")
        sub = log[sub_i][0]
        first_client = log[at("client_first", f"turn{t}")][0]
        window = [e for e in log if fin - 0.005 <= e[0] <= first_client]

        def span(what: str, detail: str, w: list = window) -> float | None:
            hit = next((e for e in w if e[2] == what and e[3] == detail), None)
            return None if hit is None else 1e3 * (hit[1] - hit[0])

        admitted = next(e for e in window if e[2] == "admitted" and e[0] >= sub - 0.005)
        admit_plan = next(e for e in window if e[2] == "plan" and e[3] == "admit")
        dispatch = next(e for e in window if e[2] == "dispatch" and f"turn{t}" in e[3].split())
        rec = {
            "kind": "turn_boundary", "request": f"turn{t}",
            "client_submit_after_finish": 1e3 * (sub - fin),
            "capture_plan": span("plan", "capture"), "capture_submit": span("submit", "capture"),
            "submit_to_admitted": 1e3 * (admitted[1] - sub),
            "admit_plan": 1e3 * (admit_plan[1] - admit_plan[0]),
            "admit_submit": span("submit", "admit"),
            "first_token_engine": 1e3 * (dispatch[0] - sub),
            "first_token_client": 1e3 * (first_client - sub),
            "first_token_handoff": 1e3 * (first_client - dispatch[0]),
        }  # fmt: skip
        rows.append(rec)
    summary = {"kind": "turn_boundary_median", "turns": "3..10", "device": args.device}
    for col in ("client_submit_after_finish", *COLUMNS):
        vals = [r[col] for r in rows[1:] if r[col] is not None]
        summary[col] = statistics.median(vals) if vals else None
    lines = [*rows, summary, alone]
    for rec in lines[:-1]:
        print(json.dumps(rec))
    lines = lines[:-1]
    print("| turn | " + " | ".join(COLUMNS) + " |")
    for rec in lines:
        cells = ["-" if rec[c] is None else f"{rec[c]:.3f}" for c in COLUMNS]
        print(f"| {rec.get('request', 'median')} | " + " | ".join(cells) + " |")
    for key, profs in sorted(profiles.items()):
        st = pstats.Stats(*profs)
        n = len(profs)
        top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: args.profile]  # type: ignore[attr-defined]
        rec = {"kind": "turn_boundary_profile", "call": key, "calls": n,
               "top": [[round(1e6 * v[2] / n, 1), round(1e6 * v[3] / n, 1), f"{Path(f[0]).name}:{f[1]}:{f[2]}"]
                       for f, v in top]}  # fmt: skip
        lines.append(rec)
        print(f"{key} ({n} calls): [internal us/call, cumulative us/call, function]")
        for row in rec["top"]:
            print("   ", row)
    if args.label:
        for rec in (*lines, alone):
            rec["variant"] = args.label
    jsonl.append(args.out, [*lines, alone])


if __name__ == "__main__":
    main()
