"""Prefill-chunk projections of a hybrid layer: sibling projections as separate GEMMs vs one fused
weight, at the chunk sizes an agent turn runs, same run.

    python benchmarks/prefill_gemm.py --shape qwen3.5-9b --rows 256,384,512

A chunk of M rows is M x N x K work whatever the layout, but each cuBLAS launch rounds its tiles
up to whole waves over the SMs: two N = 12,288 products at M = 384 run two waves each where one
N = 24,576 product runs three. Each group is replayed as a CUDA graph over rotating weight copies
(> 2x L2). Prints JSON lines: median µs per group and the achieved TFLOP/s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.shapes import HYBRID_SHAPES
from benchmarks.skinny_gemm import time_graph

ROTATE_BYTES = 256 << 20


def groups(shape: str) -> dict[str, tuple[int, list[int]]]:
    """group -> (K, the output sizes of its sibling projections)."""
    s = HYBRID_SHAPES[shape]
    h, i, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    kd = s["linear_num_key_heads"] * s["linear_key_head_dim"]
    vd = s["linear_num_value_heads"] * s["linear_value_head_dim"]
    hv = s["linear_num_value_heads"]
    return {
        "gdn_in": (h, [2 * kd + vd, vd, hv, hv]),  # in_proj_qkv | z | b | a
        "mlp_gate_up": (h, [i, i]),
        "attn_qkv": (h, [2 * s["num_attention_heads"] * d, s["num_key_value_heads"] * d,
                         s["num_key_value_heads"] * d]),  # q (with its output gate) | k | v
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-9b", choices=sorted(HYBRID_SHAPES))
    ap.add_argument("--rows", default="128,256,384,512")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    lines = []
    for name, (k, ns) in groups(args.shape).items():
        n_all = sum(ns)
        wbytes = n_all * k * 2
        copies = max(1, min(32, -(-ROTATE_BYTES // wbytes)))
        fused = [
            torch.randn(n_all, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        parts = [list(w.split(ns, dim=0)) for w in fused]  # row views: the same bytes
        parts = [[p.contiguous() for p in ps] for ps in parts]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n_all, device=dev, dtype=torch.bfloat16)
            ys = [torch.empty(m, n, device=dev, dtype=torch.bfloat16) for n in ns]

            def run_fused(i: int, x=x, y=y, ws=fused) -> None:
                torch.nn.functional.linear(x, ws[i], out=y)

            def run_separate(i: int, x=x, ys=ys, ps=parts) -> None:
                for w, out in zip(ps[i], ys, strict=True):
                    torch.nn.functional.linear(x, w, out=out)

            us = {
                "separate": time_graph(run_separate, copies),
                "fused": time_graph(run_fused, copies),
            }
            flops = 2 * m * n_all * k
            rec = {
                "kind": "prefill_gemm", "shape": args.shape, "group": name, "m": m, "k": k,
                "n": ns, "sms": sms, "separate_us": us["separate"], "fused_us": us["fused"],
                "fused_over_separate": us["fused"] / us["separate"],
                "separate_tflops": flops / us["separate"] / 1e6,
                "fused_tflops": flops / us["fused"] / 1e6,
            }  # fmt: skip
            lines.append(rec)
            print(json.dumps(rec), flush=True)
        fused.clear()
        parts.clear()
        torch.cuda.empty_cache()
    print("| group | M | separate µs | fused µs | ratio |")
    for r in lines:
        print(f"| {r['group']} | {r['m']} | {r['separate_us']:.1f} | {r['fused_us']:.1f} | "
              f"{r['fused_over_separate']:.2f} |")  # fmt: skip
    jsonl.append(args.out, lines)


if __name__ == "__main__":
    main()
