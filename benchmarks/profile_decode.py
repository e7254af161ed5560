"""Kernel-time breakdown of one decode execution (eager, under the profiler): where a step goes.

python benchmarks/profile_decode.py [--shape qwen3-1.7b] [--batch 1] [--compile decode-forward]
    [--decode-gemm skinny] [--pdl] [--full-sort] [--single] [--bundle B]

With --pdl a kernel's device time includes its wait for the one before it (it is launched
early): compare the per-kernel times and the sum against the run without.

--graph: the execution is captured and replayed as serving runs it, and the kernels' device
timeline is reported too: per step the span (first kernel start to last kernel end), the sum
of kernel times, the idle gaps between consecutive kernels and the overlap (negative gaps,
dependent launches), and which kernels the largest gaps precede. The gap totals are what launch
boundaries cost inside a graph; compare them across --pdl / --split-k / --decode-gemm runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fb"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", default="none")
    ap.add_argument("--decode-gemm", default="skinny")
    ap.add_argument("--canonical-layout", action="store_true")
    ap.add_argument("--pdl", action="store_true", help="decode kernels with dependent launch")
    ap.add_argument(
        "--pdl-trigger",
        default="after_wait",
        choices=["start", "after_wait", "end"],
        help="with --pdl: where each kernel lets the next one be scheduled",
    )
    ap.add_argument("--split-k", action="store_true",
                    help="decode products of <= 8,192 outputs split K over programs")  # fmt: skip
    ap.add_argument("--candidate-draw", choices=["ops", "kernel"], default="ops",
                    help="the candidate path's draw: compiled operations or Flare's kernel")  # fmt: skip
    ap.add_argument("--topk-levels", default=None,
                    help="CHUNK,GROUP of the top-k (prep/components/triton_topk.py set_levels)")  # fmt: skip
    ap.add_argument("--single-gemm", default="auto",
                    help="the engine's decode_single_gemm (auto: as the engine serves, which is "
                    "also what prep's compile warm-up cached)")  # fmt: skip
    ap.add_argument("--single", action="store_true",
                    help="profile decode1_lean_single, the one-row step of a request without a "
                    "seed (--batch 1, a --single-gemm other than none)")  # fmt: skip
    ap.add_argument("--full-sort", action="store_true",
                    help="profile decode{b} (which also sorts the vocabulary) instead of the "
                    "candidate-only decode{b}_lean")  # fmt: skip
    ap.add_argument(
        "--graph",
        action="store_true",
        help="replay the execution's CUDA graph and report the device timeline",
    )
    ap.add_argument("--bundle", type=Path,
                    help="profile this prepared bundle (of --shape, with a decode capacity >= "
                    "--batch) instead of preparing one")  # fmt: skip
    args = ap.parse_args()
    from prep.components.fused import auto_single_gemm

    single = args.single_gemm
    if single == "auto":
        single = auto_single_gemm(True, args.decode_gemm)
    if args.single and (args.batch != 1 or single == "none"):
        ap.error("--single profiles the one-row step: --batch 1 and a --single-gemm")
    from benchmarks.decode_latency import prep_bundle
    from benchmarks.shapes import make_checkpoint
    from flared.runner.runner import ModelRunner, RunnerPlan

    if args.topk_levels:
        from prep.components import triton_topk

        triton_topk.set_levels(*(int(v) for v in args.topk_levels.split(",")))
    layout = "canonical" if args.canonical_layout else "fused"
    bundle = args.bundle
    if bundle is None:
        work = args.work / args.shape
        ckpt = make_checkpoint(args.shape, work / "ckpt")
        bundle = work / f"bundle-{layout}-b{args.batch}"
        prep_bundle(ckpt, bundle, chunk=512, ctx=8192, capacities=str(args.batch),
                    canonical=args.canonical_layout)  # fmt: skip
    r = ModelRunner(
        bundle,
        RunnerPlan(
            "cuda",
            512,
            8,
            compile=args.compile,
            cuda_graphs=args.graph,
            attention_backend="triton",
            decode_gemm=args.decode_gemm,
            decode_pdl=args.pdl,
            decode_pdl_trigger=args.pdl_trigger,
            decode_split_k=args.split_k,
            candidate_draw=args.candidate_draw,
            decode_single_gemm=single,
        ),
    )
    # decode{b}_lean: every row samples from its candidates (top-k on, as the benchmarks ask);
    # --full-sort: decode{b}, the execution that also sorts the vocabulary for other rows
    name = f"decode{args.batch}" + ("" if args.full_sort else "_lean")
    call = r.calls[name + ("_single" if args.single else "")]
    call.inputs["rows"][: args.batch] = torch.arange(1, args.batch + 1)
    r.state.consumed[1 : args.batch + 1] = 600
    for _ in range(5):
        call.run()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call.run()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_time_total > 0:
            rows.append((e.device_time_total / 5, e.count // 5, e.key[:90]))
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    print(
        json.dumps(
            {
                "kind": "decode_profile",
                "batch": args.batch,
                "compile": args.compile,
                "layout": layout,
                "decode_gemm": args.decode_gemm,
                "pdl": args.pdl,
                "full_sort": args.full_sort,
                "candidate_draw": args.candidate_draw,
                "single_gemm": single,
                "profiled": call.name,
                "topk_levels": args.topk_levels or "default",
                "kernel_us_total": total,
                "kernels_per_step": sum(c for _, c, _ in rows),
                "top_kernels_us_count_name": [[round(t, 1), c, k] for t, c, k in rows[:40]],
            }
        )
    )
    for t, c, k in rows[:40]:
        print(f"{t:9.1f} us  x{c:4d}  {k}", flush=True)
    if args.graph:
        print(json.dumps(timeline(prof, steps=5)), flush=True)


def timeline(prof, steps: int) -> dict:
    """The device kernels of `steps` back-to-back replays, in start order: span, kernel time,
    gaps and overlaps per step, and the mean gap before each kernel name (top 12)."""
    kernels = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )  # fmt: skip
    if not kernels:
        return {"kind": "decode_timeline", "kernels": 0, "note": "no device kernels recorded"}
    per = len(kernels) // steps
    spans, busy, gaps, overlaps = [], [], [], []
    before: dict[str, list[float]] = {}
    for s in range(steps):
        ks = kernels[s * per : (s + 1) * per]
        spans.append(ks[-1][1] - ks[0][0])
        busy.append(sum(b - a for a, b, _ in ks))
        g = o = 0.0
        for (_, end, _), (start, _, name) in itertools.pairwise(ks):
            d = start - end
            if d >= 0:
                g += d
            else:
                o -= d
            before.setdefault(name[:60], []).append(d)
        gaps.append(g)
        overlaps.append(o)
    top = sorted(((sum(v) / steps, len(v) // steps, k) for k, v in before.items()), reverse=True)
    return {
        "kind": "decode_timeline", "kernels_per_step": per,
        "span_us": statistics.median(spans), "kernel_us": statistics.median(busy),
        "gap_us": statistics.median(gaps), "overlap_us": statistics.median(overlaps),
        "gap_us_before": [[round(t, 1), c, k] for t, c, k in top[:12]],
    }  # fmt: skip


if __name__ == "__main__":
    main()
