"""Kernel-time breakdown of one decode execution (eager, under the profiler): where a step goes.

    python benchmarks/profile_decode.py BUNDLE [--batch 1] [--compile]
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
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compile", default="none")
    args = ap.parse_args()
    from flared.runner.runner import ModelRunner, RunnerPlan

    r = ModelRunner(args.bundle, RunnerPlan("cuda", 512, 8, compile=args.compile, cuda_graphs=False, attention_backend="triton"))
    call = r.calls[f"decode{args.batch}"]
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
    print(json.dumps({"kind": "decode_profile", "batch": args.batch, "compile": args.compile,
                      "kernel_us_total": total, "kernels_per_step": sum(c for _, c, _ in rows)}))
    for t, c, k in rows[:25]:
        print(f"{t:9.1f} us  x{c:4d}  {k}")


if __name__ == "__main__":
    main()
