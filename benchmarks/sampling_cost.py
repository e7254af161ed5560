"""Device time of one step's sampling over a vocabulary, by path: what the sort costs.

    python benchmarks/sampling_cost.py [--vocab 151936] [--rows 1,2,4,8] [--top-logprobs 20]
        [--device cuda] [--no-compile] [--out FILE]

Per batch size, three variants of prep.components.sampling.sample on the same random logits,
penalty histogram and grammar-free rows (top-k 20, top-p 0.95, T 1, the benchmarks' requests):
  sorted      the implementation before the candidate path: a sort of the whole distribution,
              its scan, and the library's top-k of the raw logprobs (composed here from the
              module's filtered_probs_sorted and sample_from_sorted)
  both        sample(paths="both"): the candidate path for rows with top-k <= CANDIDATES and
              the sorted path for the others, chosen per row (decode{b} of the runner)
  candidates  sample(paths="candidates"): the candidate path alone (decode{b}_lean)
  candidates-library  the same with the library's two-stage top-k (sampling.library_topk)
              where CUDA runs Flare's kernel (prep/components/triton_topk.py): what it saves
  candidates-kernel   the candidate path with its top-k, filters and draw in Flare's two-launch
              kernel (candidate_draw "kernel", prep/components/candidate_draw.py; CUDA)
  candidates-no-top   the candidate path for rows that did not ask for top logprobs (the
              common request: `want_top` False, whose top-k of the logprobs does no work)
  candidates-two-launch, candidates-kernel-two-launch   candidates and candidates-kernel with
              other top-k levels (--levels CHUNK,GROUP: triton_topk.set_levels; CUDA; by default
              4,096-value chunks and no middle stage, the two-launch form the default replaced)
each compiled (as the decode executions' sampling region is, unless --no-compile) and, on CUDA,
captured in a CUDA graph and replayed back to back: median device time per step over
--repeats timing windows, and its ratio to the sorted variant's (`vs_sorted`). Writes one JSON
line per (variant, rows) to --out and prints a table; all variants run in the same process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from prep.components import sampling
from prep.components.sampling import (
    RowParams,
    apply_penalties,
    filtered_probs_sorted,
    sample,
    sample_from_sorted,
    uniform_from_counter,
)

Inputs = tuple[torch.Tensor, torch.Tensor, RowParams]


def sorted_sample(
    logits: torch.Tensor, hist: torch.Tensor, params: RowParams, k: int
) -> tuple[torch.Tensor, ...]:
    """The sorted path for every row, with the library's top-k for the logprobs."""
    raw = torch.log_softmax(logits, dim=-1)
    kept, ids = filtered_probs_sorted(apply_penalties(logits, hist, params), params)
    token = sample_from_sorted(kept, ids, uniform_from_counter(params.seed, params.counter))
    top_lp, top_ids = torch.topk(raw, k, dim=-1)
    return token, raw.gather(1, token[:, None]).squeeze(1), top_ids, top_lp


@contextlib.contextmanager
def kernel_draw_in() -> Iterator[None]:
    """The candidate draw in Flare's kernel while a variant is traced and captured."""
    sampling.set_candidate_draw("kernel")
    try:
        yield
    finally:
        sampling.set_candidate_draw("ops")


@contextlib.contextmanager
def topk_levels_in(chunk: int, group: int) -> Iterator[None]:
    """The top-k at other levels while a variant is traced and captured."""
    from prep.components import triton_topk

    kept = triton_topk.CHUNK, triton_topk.GROUP
    triton_topk.set_levels(chunk, group)
    try:
        yield
    finally:
        triton_topk.set_levels(*kept)


@contextlib.contextmanager
def library_topk_in() -> Iterator[None]:
    """sampling's top-k as the library's while a variant is traced and captured."""
    kept = sampling.triton_topk
    sampling.triton_topk = None  # chunked_topk's library path (sampling.library_topk)
    try:
        yield
    finally:
        sampling.triton_topk = kept


def inputs(rows: int, vocab: int, device: torch.device) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(device)
    hist = torch.zeros(rows, vocab, dtype=torch.int32)
    hist[:, torch.randint(0, vocab, (600,), generator=g)] = 1  # a prompt's worth of tokens
    full = torch.full((rows,), 1.0, device=device)
    params = RowParams(
        temperature=full, top_k=torch.full((rows,), 20, device=device), top_p=full * 0.95,
        min_p=full * 0.0, repetition_penalty=full * 1.1, presence_penalty=full * 0.0,
        frequency_penalty=full * 0.0, seed=torch.arange(rows, device=device),
        counter=torch.zeros(rows, dtype=torch.int64, device=device),
    )  # fmt: skip
    return logits, hist.to(device), params


def timed(fn: Callable[[], object], device: torch.device, steps: int, repeats: int) -> float:
    """Median milliseconds per call over `repeats` windows of `steps` calls (a CUDA graph's
    replays on CUDA)."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t) / steps * 1e3)
        return statistics.median(times)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()  # compiles, warms the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--top-logprobs", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--levels", default="4096,0", help="CHUNK,GROUP of the -two-launch variants")
    args = ap.parse_args()
    levels = tuple(int(v) for v in args.levels.split(","))
    device = torch.device(args.device)
    k = args.top_logprobs

    def wrap(f: Callable[..., tuple[torch.Tensor, ...]]) -> Callable[..., tuple[torch.Tensor, ...]]:
        return f if args.no_compile else torch.compile(f, dynamic=False)

    variants = {
        "sorted": wrap(lambda lg, h, p: sorted_sample(lg, h, p, k)),
        "both": wrap(lambda lg, h, p: sample(lg, h, p, None, k, "both")),
        "candidates": wrap(lambda lg, h, p: sample(lg, h, p, None, k, "candidates")),
        "candidates-library": wrap(lambda lg, h, p: sample(lg, h, p, None, k, "candidates")),
        "candidates-kernel": wrap(lambda lg, h, p: sample(lg, h, p, None, k, "candidates")),
        "candidates-two-launch": wrap(lambda lg, h, p: sample(lg, h, p, None, k, "candidates")),
        "candidates-kernel-two-launch": wrap(
            lambda lg, h, p: sample(lg, h, p, None, k, "candidates")
        ),
        "candidates-no-top": wrap(
            lambda lg, h, p: sample(
                lg, h, p, None, k, "candidates", torch.zeros_like(p.top_k, dtype=torch.bool)
            )
        ),
    }

    def other_levels() -> contextlib.AbstractContextManager[None]:
        return topk_levels_in(*levels)

    switches: dict[str, list[Callable[[], contextlib.AbstractContextManager[None]]]] = {
        "candidates-library": [library_topk_in],
        "candidates-kernel": [kernel_draw_in],
        "candidates-two-launch": [other_levels],
        "candidates-kernel-two-launch": [kernel_draw_in, other_levels],
    }
    records = []
    for rows in (int(r) for r in args.rows.split(",")):
        logits, hist, params = inputs(rows, args.vocab, device)
        tokens = {}
        args_ = (logits, hist, params)
        for name, fn in variants.items():
            with contextlib.ExitStack() as stack:
                for enter in switches.get(name, []):
                    stack.enter_context(enter())
                tokens[name] = fn(*args_)[0].cpu()  # traced (and below, captured) in here
                ms = timed(lambda fn=fn, a=args_: fn(*a), device, args.steps, args.repeats)
            records.append({
                "bench": "sampling_cost", "variant": name, "rows": rows, "vocab": args.vocab,
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "compiled": not args.no_compile, "top_logprobs": k, "us_per_step": 1e3 * ms,
            })  # fmt: skip
        # the same rows, the same draws: both paths agree with each other for these rows
        assert torch.equal(tokens["both"], tokens["candidates"]), (tokens, rows)
        assert torch.equal(tokens["candidates"], tokens["candidates-library"]), (tokens, rows)
        assert torch.equal(tokens["candidates"], tokens["candidates-no-top"]), (tokens, rows)
        assert torch.equal(tokens["candidates"], tokens["candidates-two-launch"]), (tokens, rows)
        assert torch.equal(tokens["candidates-kernel"], tokens["candidates-kernel-two-launch"])
        # the kernel's draw may differ within rounding of a boundary (candidate_draw.py): counted
        same = int((tokens["candidates-kernel"] == tokens["candidates"]).sum())
        for r in records[-len(variants) :]:
            r["kernel_draw_same_tokens"] = f"{same}/{rows}"
        base = next(
            r["us_per_step"] for r in records if r["rows"] == rows and r["variant"] == "sorted"
        )
        for r in records[-len(variants) :]:
            r["vs_sorted"] = r["us_per_step"] / base
    jsonl.append(args.out, records)
    for r in records:
        print(json.dumps(r))
    print(f"{'variant':>18} {'rows':>5} {'us/step':>9} {'vs sorted':>9}")
    for r in records:
        print(f"{r['variant']:>18} {r['rows']:>5} {r['us_per_step']:>9.1f} {r['vs_sorted']:>9.2f}")


if __name__ == "__main__":
    main()
