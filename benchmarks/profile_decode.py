"""Kernel-time breakdown of one decode execution (eager, under the profiler): where a step goes.

python benchmarks/profile_decode.py [--shape qwen3-1.7b] [--batch 1] [--compile decode-forward]
    [--decode-gemm skinny] [--pdl] [--full-sort] [--bundle B]

With --pdl a kernel's device time includes its wait for the one before it (it is launched
early): compare the per-kernel times and the sum against the run without.
"""

from __future__ import annotations

import argparse
import json
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
    ap.add_argument("--split-k", action="store_true",
                    help="decode products of <= 8,192 outputs split K over programs")  # fmt: skip
    ap.add_argument("--full-sort", action="store_true",
                    help="profile decode{b} (which also sorts the vocabulary) instead of the "
                    "candidate-only decode{b}_lean")  # fmt: skip
    ap.add_argument("--bundle", type=Path,
                    help="profile this prepared bundle (of --shape, with a decode capacity >= "
                    "--batch) instead of preparing one")  # fmt: skip
    args = ap.parse_args()
    from benchmarks.decode_latency import prep_bundle
    from benchmarks.shapes import make_checkpoint
    from flared.runner.runner import ModelRunner, RunnerPlan

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
            cuda_graphs=False,
            attention_backend="triton",
            decode_gemm=args.decode_gemm,
            decode_pdl=args.pdl,
            decode_split_k=args.split_k,
        ),
    )
    # decode{b}_lean: every row samples from its candidates (top-k on, as the benchmarks ask);
    # --full-sort: decode{b}, the execution that also sorts the vocabulary for other rows
    call = r.calls[f"decode{args.batch}" + ("" if args.full_sort else "_lean")]
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
                "kernel_us_total": total,
                "kernels_per_step": sum(c for _, c, _ in rows),
            }
        )
    )
    for t, c, k in rows[:40]:
        print(f"{t:9.1f} us  x{c:4d}  {k}", flush=True)


if __name__ == "__main__":
    main()
