"""Kernel-time breakdown of one prepared execution of a bundle, as the daemon would run it
(the bundle's compile mode, without CUDA graphs so the profiler sees every kernel), plus the
graph-replay time of the same execution for comparison.

    python benchmarks/profile_execution.py --bundle B --call prefill512 [--start 0] [--top 25]
        [--fresh --call prefill4096_fresh]

A prefill call gets one request of `--start` cached tokens plus the call's capacity of new ones
on fresh pages; a decode call gets that many rows at position `--start`. Prints one JSON line,
then the top kernels (µs per run, launches per run), grouped into GEMM / attention / other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _group(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "cublas", "matmul", "skinny", "nvjet")):
        return "gemm"
    if any(k in n for k in ("attention", "_prefill_kernel", "_decode_partial", "_decode_merge",
                            "fmha", "flash", "cudnn", "sdpa", "own_keys")):  # fmt: skip
        return "attention"
    if any(k in n for k in ("gdn", "chunk", "recurrent", "fla")):
        return "gdn"
    return "other"


def setup_call(r, name: str, start: int) -> None:
    """Stage a plausible input for `name` directly into its static device buffers."""
    call = r.calls[name]
    ps = r.page_size
    inp = call.inputs
    if name.startswith("prefill"):
        c = int(name.removeprefix("prefill").split("_")[0])
        pages = -(-(start + c) // ps)
        r.state.page_table[1, :pages] = torch.arange(pages, device=r.device)
        r.state.consumed[1] = start
        r.state.finished[1] = False
        pos = torch.arange(start, start + c, device=r.device)
        inp["tokens"].copy_(torch.randint(10, 1000, (c,), device=r.device))
        inp["positions"].copy_(pos)
        inp["slots"].copy_(pos)  # pages 0.. in order: slot = position
        inp["row"].fill_(1)
        inp["num_valid"].fill_(c)
    elif name.startswith(("decode", "resume")):
        b = int(name.removeprefix("decode").removeprefix("resume").split("_")[0])
        pages = -(-(start + 1) // ps)
        for i in range(b):
            r.state.page_table[1 + i, :pages] = torch.arange(i * pages, (i + 1) * pages,
                                                             device=r.device)  # fmt: skip
        rows = torch.arange(1, b + 1, device=r.device)
        r.state.consumed[rows] = start
        r.state.finished[rows] = False
        r.state.max_tokens[rows] = 1 << 30
        inp["rows"].copy_(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", type=Path, required=True)
    ap.add_argument("--call", action="append", required=True)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--pages", type=int, default=2048)
    ap.add_argument(
        "--gemm", default="skinny", help="RunnerPlan.decode_gemm (skinny|fused|folded|cublas)"
    )
    ap.add_argument("--fresh", action="store_true",
                    help="build the prefill{C}_fresh executions too (a chunk that starts its "
                    "prompt attends over its own keys), as the engine does by default on CUDA")  # fmt: skip
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from flared.runner.runner import ModelRunner, RunnerPlan
    from prep.components.fused import auto_single_gemm

    results = {}
    for graphs in (True, False):
        r = ModelRunner(args.bundle, RunnerPlan("cuda", args.pages, 8, compile="bundle",
                                                cuda_graphs=graphs, attention_backend="triton",
                                                decode_gemm=args.gemm,
                                                decode_single_gemm=auto_single_gemm(True, args.gemm),
                                                prefill_fresh=args.fresh))  # fmt: skip
        for name in args.call:
            setup_call(r, name, args.start)
            call = r.calls[name]
            with torch.cuda.stream(r.stream):
                for _ in range(3):
                    setup_call(r, name, args.start)
                    call.run()
                torch.cuda.synchronize()
                if graphs:
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record(r.stream)
                    for _ in range(10):
                        call.run()
                    end.record(r.stream)
                    end.synchronize()
                    results[name] = {"replay_ms": start.elapsed_time(end) / 10}
                    continue
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        call.run()
                    torch.cuda.synchronize()
            rows = [(e.device_time_total / 5, e.count // 5, e.key[:100])
                    for e in prof.key_averages() if e.device_time_total > 0]  # fmt: skip
            rows.sort(reverse=True)
            groups: dict[str, float] = {}
            for t, _, k in rows:
                groups[_group(k)] = groups.get(_group(k), 0.0) + t / 1e3
            rec = {"kind": "execution_profile", "call": name, "start": args.start,
                   "compile": r.compile_mode, **results[name],
                   "kernel_ms": sum(t for t, _, _ in rows) / 1e3,
                   "launches": sum(c for _, c, _ in rows),
                   "group_ms": {k: round(v, 3) for k, v in groups.items()}}  # fmt: skip
            print(json.dumps(rec), flush=True)
            for t, c, k in rows[: args.top]:
                print(f"{t:9.1f} us  x{c:4d}  {k}", flush=True)
        del r
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
