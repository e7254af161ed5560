"""Prefix cache on an agent trace: per-turn TTFT with checkpoints vs the same turns recomputed,
in one run, plus the prefix-hit, full-prompt-hit and cold-short TTFTs of issue #4.

    python benchmarks/agent_trace.py --bundle BUNDLE [--device cuda] [--system 2048] [--turn 300]

The trace (`Trace`): a system prompt with tool declarations, then 10 turns of the agent loop:
each prompt ends in an assistant header, the model generates its tool call (40 tokens), and
the next prompt appends that output and a tool result of a few hundred tokens (message
endpoints declared, as the frontend declares them); two branches from turn 5 replace its tool
result. Token ids are random (the cost of a prefill does not depend on which tokens they are).
TTFT is submit → first token, median of --repeat runs. By default each turn is sent the moment the
previous one finishes (no tool time: the worst case, the previous turn's terminal capture still
being planned); `--tool-ms` waits that long first, as a real tool call would. Without the cache nothing is captured,
so the recompute half prefills each prompt in full-size chunks. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (n,), generator=g).tolist()


def ttft_ms(
    eng, prompt: list[int], endpoints: tuple[int, ...], seed: int, max_tokens: int = 2
) -> tuple[float, int, list[int]]:
    """(submit -> first token ms, cached prompt tokens, generated ids) of one request."""
    from flared.engine.events import FinishEvent, TokenEvent
    from flared.requests import SamplingParams

    t0 = time.perf_counter()
    first = None
    cached = 0
    out: list[int] = []
    for ev in eng.stream(prompt, max_tokens=max_tokens, ignore_eos=True, endpoints=endpoints,
                         sampling=SamplingParams(temperature=1.0, seed=seed)):  # fmt: skip
        if isinstance(ev, TokenEvent):
            first = first or time.perf_counter()
            out += [t.token_id for t in ev.tokens]
        if isinstance(ev, FinishEvent):
            cached = ev.cached_tokens
    assert first is not None
    return 1e3 * (first - t0), cached, out


STEP_STATS = ("step_ms", "host_ms", "device_step_ms", "host_submission_gap_ms", "ttft_ms")


def step_totals(eng) -> dict[str, tuple[int, float]]:
    """(count, sum) of the engine's per-step timing series: differences between two calls give
    the steps one request took and where their time went (host submit, device, idle gap)."""
    stats = eng.stats()
    out = {}
    for key in STEP_STATS:
        s = stats[key]
        out[key] = (int(s.get("count", 0)), float(s.get("mean", 0.0)) * int(s.get("count", 0)))
    return out


@contextlib.contextmanager
def step_trace(eng) -> Iterator[list[dict]]:
    """The engine's steps completed inside the block, in order, one dict each: what the step
    ran (the prefill chunk's start and tokens and whether it sampled the first token, the
    decode rows; an empty step has neither) and its host submit, device and idle-gap
    milliseconds (device and gap on CUDA only). Per step, where `step_delta` sums."""
    runner = eng.runner
    wait = runner.wait
    steps: list[dict] = []

    def traced(pending):
        result = wait(pending)
        plan, extra = pending.plan, result.extra
        rec: dict = {"prefill_start": None, "prefill_tokens": 0, "sampled": False,
                     "decode_rows": len(plan.decode.rows) if plan.decode is not None else 0,
                     "host_ms": round(1e3 * extra.get("host_s", 0.0), 3)}  # fmt: skip
        if plan.prefill is not None:
            rec["prefill_start"] = plan.prefill.start_pos
            rec["prefill_tokens"] = len(plan.prefill.token_ids)
            rec["sampled"] = plan.prefill.sample
        for key in ("device_ms", "gap_ms"):
            if key in extra:
                rec[key] = round(extra[key], 3)
        steps.append(rec)
        return result

    runner.wait = traced  # the engine thread's next wait goes through the trace
    try:
        yield steps
    finally:
        del runner.wait  # the class's own method again


def step_delta(before: dict, after: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for key in STEP_STATS:
        n = after[key][0] - before[key][0]
        out[f"{key}_n"] = n
        out[f"{key}_sum"] = round(after[key][1] - before[key][1], 3)
    return out


def decode_itl_ms(eng, vocab: int, seed: int, tokens: int = 64) -> float:
    """Mean inter-token latency after the first token of one request decoding alone (the decode step the
    full-prompt-hit target is measured against)."""
    from flared.engine.events import TokenEvent
    from flared.requests import SamplingParams

    first, last, n = 0.0, 0.0, 0
    for ev in eng.stream(_tokens(64, 7000 + seed, vocab), max_tokens=tokens, ignore_eos=True,
                         sampling=SamplingParams(temperature=1.0, top_k=20, top_p=0.95,
                                                 seed=seed)):  # fmt: skip
        if isinstance(ev, TokenEvent):
            last = time.perf_counter()
            first = first or last
            n += len(ev.tokens)
    return 1e3 * (last - first) / max(n - 1, 1)


def device_ms(stream, fn, repeats: int) -> float:
    """Mean device time of fn() on `stream` over `repeats` launches after one warm launch."""
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(repeats):
            fn()
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / repeats


def state_copy_bandwidth(eng, repeats: int = 20) -> list[dict]:
    """Device time of the prepared snapshot copies on the engine's runner (idle engine): one
    state-row snapshot (recurrent matrices, conv histories, hidden vector) and one tail-page
    copy over every attention layer, as GB/s counting bytes read + written. The copy itself is
    its prepared call replayed over inputs staged once (`op`); `<op>_call` repeats the whole
    call as a step issues it (stage, upload, replay), which on an idle GPU is host-bound."""
    from flared.engine.plan import PageCopy

    r = eng.runner
    if r.device.type != "cuda":
        return []
    out = []
    pool = r.pool
    jobs = []
    if pool is not None and pool.num_snapshot_rows:
        row_bytes = pool.row_bytes()

        def snapshot() -> None:
            r.steps._run_chunked(
                "state_snapshot",
                {"src": [1], "dst": [pool.first_snapshot_row], "consumed": [0]},
                {"src": 0, "dst": 0, "consumed": 0},
            )

        snapshot()
        jobs.append(("state_snapshot", 2 * row_bytes, r.calls["state_snapshot"].run))
        jobs.append(("state_snapshot_call", 2 * row_bytes, snapshot))
        # the measured copy bandwidth to compare against: one contiguous copy of as many bytes
        flat = torch.empty(2, row_bytes, dtype=torch.uint8, device=r.device)
        jobs.append(("memcpy_baseline", 2 * row_bytes, lambda: flat[1].copy_(flat[0])))
    page_bytes = sum(t[0].nbytes for t in (*r.kv.k_pages, *r.kv.v_pages))

    def tail() -> None:
        r.steps._copy_pages([PageCopy(src_page=0, dst_page=1)])

    tail()
    jobs.append(("tail_page_copy", 2 * page_bytes, r.calls["copy_pages"].run))
    jobs.append(("tail_page_copy_call", 2 * page_bytes, tail))
    for name, nbytes, fn in jobs:
        us = 1e3 * device_ms(r.stream, fn, repeats)
        out.append(dict(kind="state_copy", op=name, bytes_moved=nbytes, us=us,
                        gb_per_s=nbytes / us / 1e3))  # fmt: skip
    return out


def execution_device_ms(eng, repeats: int = 10) -> list[dict]:
    """Device time of each prepared prefill and decode execution, replayed on the idle engine
    over whatever its static inputs last held (the same work as a served step: every capacity
    runs its whole padded shape). TTFT minus this is the host's share of a step."""
    r = eng.runner
    if r.device.type != "cuda":
        return []
    return [dict(kind="execution_device", call=name, ms=device_ms(r.stream, call.run, repeats))
            for name, call in r.calls.items()
            if name.startswith(("prefill", "decode", "resume"))]  # fmt: skip


class Trace:
    """The agent loop of one conversation: turn t's prompt is the history plus an 11-token
    assistant header; the model's own 40 generated tokens (its tool call) and a tool result of
    `turn` tokens then join the history, with message endpoints after each, as the frontend
    declares them. Turn t+1 therefore extends turn t's prompt and output exactly, as a real
    agent's does, and can resume from turn t's terminal checkpoint. Two branches from turn 5
    replace its tool result. `salt` makes every repeat a new conversation (no hits across
    repeats). Every drawn token list (headers, tool results) is drawn here, before any request:
    an agent's tool runs in its own process, not on the serving process's GIL between one
    turn's finish and the next turn's submit."""

    TURNS, HEADER, CALL = 10, 11, 40

    def __init__(self, system: int, turn: int, vocab: int, salt: int) -> None:
        self.turn, self.vocab, self.s = turn, vocab, 10_000 * salt
        self.history = _tokens(system, 1 + self.s, vocab)
        self.ends = [system]
        self.branch_base: tuple[list[int], list[int]] | None = None
        self._drawn = {
            seed: _tokens(n, seed + self.s, vocab)
            for n, seeds in (
                (self.HEADER, [300 + t for t in range(1, self.TURNS + 1)] + [501, 502]),
                (turn, [200 + t for t in range(1, self.TURNS + 1)] + [401, 402]),
            )
            for seed in seeds
        }

    def _draw(self, n: int, seed: int) -> list[int]:
        out = self._drawn[seed]
        assert len(out) == n
        return out

    def run(self, serve) -> None:
        """Runs every request through `serve(label, prompt, endpoints) -> generated ids`, in
        order (each prompt depends on the outputs before it)."""
        for t in range(1, self.TURNS + 1):
            prompt = self.history + self._draw(self.HEADER, 300 + t)
            ends = tuple(self.ends)
            out = serve(f"turn{t}", prompt, ends)
            self.history = prompt + list(out)
            self.ends.append(len(self.history))  # the assistant's tool call ends
            if t == 5:
                self.branch_base = (list(self.history), list(self.ends))
            self.history += self._draw(self.turn, 200 + t)  # the tool result
            self.ends.append(len(self.history))
        assert self.branch_base is not None
        for b in (1, 2):
            base, ends = self.branch_base
            history = base + self._draw(self.turn, 400 + b)
            prompt = history + self._draw(self.HEADER, 500 + b)
            serve(f"branch{b}", prompt, (*ends, len(history)))


def dispatch_yield(args: argparse.Namespace) -> dict[str, float | None]:
    """EngineConfig keywords for --dispatch-yield-us and --first-token-yield-us (absent: the
    engine's default; < 0: off)."""
    out: dict[str, float | None] = {}
    for flag, key in (("dispatch_yield_us", "dispatch_yield_s"),
                      ("first_token_yield_us", "first_token_yield_s")):  # fmt: skip
        us = getattr(args, flag, None)
        if us is not None:
            out[key] = None if us < 0 else us / 1e6
    return out


def run_trace(eng, args, vocab: int, salt: int) -> dict[str, tuple[float, int, dict]]:
    """Request label -> (TTFT ms, cached tokens, step deltas) of one conversation's trace."""
    out: dict[str, tuple[float, int, dict]] = {}

    def serve(name: str, prompt: list[int], ends: tuple[int, ...]) -> list[int]:
        if args.tool_ms > 0:  # the tool runs between a turn's end and the next request
            time.sleep(args.tool_ms / 1e3)
        before = step_totals(eng)
        ms, cached, generated = ttft_ms(eng, prompt, ends, seed=salt, max_tokens=Trace.CALL)
        out[name] = (ms, cached, step_delta(before, step_totals(eng)))
        return generated

    Trace(args.system, args.turn, vocab, salt).run(serve)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--turn", type=int, default=300)
    ap.add_argument("--prefix", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gil-switch-ms", type=float, default=0.2,
                    help="the engine's GIL switch interval (the daemon's default, 0.2 ms; 0 "
                    "leaves Python's 5 ms)")  # fmt: skip
    ap.add_argument("--tool-ms", type=float, default=0.0,
                    help="time the agent's tool takes before each request (0: the next turn is "
                    "sent the moment the previous one finishes, the worst case: the previous "
                    "turn's terminal capture is still being planned)")  # fmt: skip
    ap.add_argument("--dispatch-yield-us", type=float, default=None,
                    help="EngineConfig.dispatch_yield_s in µs (default: the engine's)")  # fmt: skip
    ap.add_argument("--first-token-yield-us", type=float, default=None,
                    help="EngineConfig.first_token_yield_s in µs (default: the engine's)")  # fmt: skip
    ap.add_argument("--out", type=Path)
    ap.add_argument("--mode", choices=["both", "cache", "recompute"], default="both",
                    help="both: each half in its own process (a process gives its device "
                    "memory back only when it exits)")  # fmt: skip
    args = ap.parse_args()
    if args.mode == "both":
        _both(sys.argv[1:])
        return
    from flared.llm_engine import Engine, EngineConfig

    rows: list[dict] = []

    def emit(**rec: object) -> None:
        rows.append(rec)
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as fh:
                fh.write(line + "\n")

    for cache in (args.mode == "cache",):
        t0 = time.perf_counter()
        config = EngineConfig(device=args.device, prefix_cache=cache,
                              gil_switch_interval_s=args.gil_switch_ms / 1e3,
                              **dispatch_yield(args))  # fmt: skip
        eng = Engine(args.bundle, config).start()
        emit(kind="startup", prefix_cache=cache, seconds=time.perf_counter() - t0,
             compile=eng.runner.compile_mode, switch_interval_ms=sys.getswitchinterval() * 1e3,
             dispatch_yield_s=eng.config.dispatch_yield_s,
             first_token_yield_s=eng.config.first_token_yield_s)  # fmt: skip
        vocab = eng.manifest.geometry.vocab_size
        label = "cache" if cache else "recompute"
        # the trace, --repeat times (each repeat a new conversation)
        per: dict[str, list[float]] = {}
        hit_tokens: dict[str, int] = {}
        turn_steps: dict[str, dict[str, float]] = {}
        for r in range(args.repeat):
            for name, (ms, cached, steps) in run_trace(eng, args, vocab, r).items():
                per.setdefault(name, []).append(ms)
                hit_tokens[name] = cached
                turn_steps[name] = steps  # the last repeat's
        for name, v in per.items():
            emit(kind="agent_turn", mode=label, request=name, ttft_ms=statistics.median(v),
                 cached_tokens=hit_tokens[name], steps=turn_steps[name])  # fmt: skip
        # prefix + 11-token tail, full-prompt repeat, cold 11 tokens
        if cache:
            extra: dict[str, list[float]] = {"prefix_hit": [], "full_hit": [], "cold_11": []}
            reused: dict[str, int] = {}
            steps: dict[str, dict[str, float]] = {}
            for r in range(args.repeat):
                prefix = _tokens(args.prefix, 900 + r, vocab)
                ttft_ms(eng, prefix, (), seed=r)  # checkpoint at the prompt boundary
                for name, prompt, ends in (
                    ("prefix_hit", prefix + _tokens(11, 950 + r, vocab), (args.prefix,)),
                    ("full_hit", prefix, ()),
                    ("cold_11", _tokens(11, 990 + r, vocab), ()),
                ):
                    before = step_totals(eng)
                    ms, reused[name], _ = ttft_ms(eng, prompt, ends, r)
                    extra[name].append(ms)
                    steps[name] = step_delta(before, step_totals(eng))  # the last repeat's
            for name, v in extra.items():
                emit(kind="prefix_ttft", request=name, prefix=args.prefix,
                     ttft_ms=statistics.median(v), cached_tokens=reused[name],
                     steps=steps[name])  # fmt: skip
            # the GIL hand-off, same run: full-prompt hits with Python's default 5 ms switch
            # interval vs the engine's setting
            prefix = _tokens(args.prefix, 900, vocab)
            configured = sys.getswitchinterval()
            for interval in (0.005, 0.0002):
                sys.setswitchinterval(interval)
                hits = [ttft_ms(eng, prefix, (), seed=9)[0] for _ in range(7)]
                emit(kind="full_hit_gil", switch_interval_ms=interval * 1e3,
                     ttft_ms=statistics.median(hits))  # fmt: skip
            sys.setswitchinterval(configured)  # the rest measures the engine as configured
            emit(kind="decode_itl", ms=decode_itl_ms(eng, vocab, 1))
            for rec in state_copy_bandwidth(eng):
                emit(**rec)
            for rec in execution_device_ms(eng):  # last: it leaves rows in arbitrary states
                emit(**rec)
        emit(kind="engine_stats", mode=label,
             **{k: v for k, v in eng.stats().items() if isinstance(v, (int, float))})  # fmt: skip
        eng.shutdown()


def _both(argv: list[str]) -> None:
    """Run the cache half, then the recompute half, each in a fresh process; print the table."""
    import subprocess

    results: dict[str, dict[str, float]] = {}
    for mode in ("cache", "recompute"):
        proc = subprocess.run([sys.executable, __file__, *argv, "--mode", mode],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
        for line in proc.stdout.splitlines():
            print(line, flush=True)
            if line.startswith("{"):
                rec = json.loads(line)
                if rec.get("kind") == "agent_turn":
                    results.setdefault(rec["request"], {})[mode] = rec["ttft_ms"]
        if proc.returncode:
            raise SystemExit(f"the {mode} half failed ({proc.returncode})")
    print("\n| request | cache ms | recompute ms | speed-up |")
    for name, d in results.items():
        c, r = d.get("cache", 0.0), d.get("recompute", 0.0)
        print(f"| {name} | {c:.1f} | {r:.1f} | {r / c if c else 0:.1f}x |")


if __name__ == "__main__":
    main()
