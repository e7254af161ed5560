"""A decode step's SiLU MLP: the skinny chain (gate|up, then down with SiLU * up in its prologue:
two launches, as the `fused` decode layers run it; and with the activation as a launch of its
own, three, as `skinny` runs it) against the one-launch MLP (prep.components.skinny_mlp) over
its configurations, same run.

    python benchmarks/skinny_mlp.py --shape qwen3-1.7b [--rows 1,4] [--sweep] [--out F]

Each form is replayed as a CUDA graph of many MLPs over rotating weight copies (> 2x L2), so the
times are those of cold weight streams, as inside a decode step. Prints JSON lines: median µs
per MLP and the achieved weight bandwidth per form, the one-launch form's error against the
chain, and the programs each configuration ran with (capped by residency).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.shapes import SHAPES
from benchmarks.skinny_gemm import ROTATE_BYTES, time_graph
from prep.components import skinny_mlp
from prep.components.skinny_gemm import skinny_matmul_into


def configs(sweep: bool) -> list[skinny_mlp.MlpConfig]:
    """The default and, with `sweep`, programs per SM x down's K splits x phase-1 tiles x
    pipeline stages."""
    base = skinny_mlp.DEFAULT
    if not sweep:
        return [base]
    out = [base]
    for per_sm, split2, n1 in itertools.product((1, 2, 3), (1, 2, 4), (16, 32)):
        c = skinny_mlp.MlpConfig(block_n1=n1, per_sm=per_sm, split2=split2)
        if c != base:
            out.append(c)
    out.append(skinny_mlp.MlpConfig(num_stages=4, per_sm=2, split2=2))
    return out


def measure(shape: str, m: int, gus: list, downs: list, sweep: bool) -> dict:
    """One row count: the chains and every configuration, as one JSON record."""
    dev, hidden, inter = gus[0].device, downs[0].shape[0], downs[0].shape[1]
    copies, wbytes = len(gus), 3 * hidden * inter * 2
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    x = torch.randn(m, hidden, device=dev, dtype=torch.bfloat16)
    gu = torch.empty(m, 2 * inter, device=dev, dtype=torch.bfloat16)
    act = torch.empty(m, inter, device=dev, dtype=torch.bfloat16)
    y = torch.empty(m, hidden, device=dev, dtype=torch.bfloat16)

    def chain2(i: int) -> None:
        skinny_matmul_into(gu, x, gus[i])
        skinny_matmul_into(y, gu, downs[i], silu_mul=True)

    def chain3(i: int) -> None:
        skinny_matmul_into(gu, x, gus[i])
        torch.mul(F.silu(gu[:, :inter]), gu[:, inter:], out=act)
        skinny_matmul_into(y, act, downs[i])

    times = {"chain2": time_graph(chain2, copies), "chain3": time_graph(chain3, copies)}
    chain2(0)
    ref = y.clone()
    errs, grids = {}, {}
    for c in configs(sweep):
        for persistent in (True, False):
            label = c.label() + ("" if persistent else "-2launch")
            if not persistent and c != skinny_mlp.DEFAULT:
                continue

            def one(i: int, c=c, persistent=persistent) -> None:
                skinny_mlp.skinny_mlp_into(y, x, gus[i], downs[i], persistent=persistent, cfg=c)

            try:
                times[label] = time_graph(one, copies)
            except Exception as exc:  # a configuration the compiler or the SM rejects
                print(f"# M={m} {label}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            one(0)
            errs[label] = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
            want = c.per_sm * sms
            grids[label] = skinny_mlp.GRIDS.get((dev, c, hidden, inter, x.dtype, want), want)
    ones = {k: v for k, v in times.items() if not k.startswith("chain")}
    best = min(ones, key=ones.__getitem__)
    rec = {
        "kind": "skinny_mlp", "shape": shape, "hidden": hidden, "inter": inter, "m": m,
        "chain2_us": times["chain2"], "chain3_us": times["chain3"], "best": best,
        "best_us": ones[best], "best_gbps": wbytes / ones[best] / 1e3,
        "default_us": ones.get(skinny_mlp.DEFAULT.label()),
        "best_over_chain2": ones[best] / times["chain2"], "rel_err_vs_chain2": errs[best],
        "max_rel_err_vs_chain2": max(errs.values()),
        "all_us": {k: round(v, 2) for k, v in sorted(times.items(), key=lambda kv: kv[1])},
        "programs": grids, "device": torch.cuda.get_device_name(dev),
    }  # fmt: skip
    return rec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--sweep", action="store_true", help="try the configurations of `configs`")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    cfg = SHAPES[args.shape]
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    wbytes = 3 * hidden * inter * 2
    copies = max(2, -(-ROTATE_BYTES // wbytes))
    gus = [
        torch.randn(2 * inter, hidden, device=dev, dtype=torch.bfloat16) * 0.02
        for _ in range(copies)
    ]
    downs = [
        torch.randn(hidden, inter, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)
    ]
    lines = []
    for m in (int(r) for r in args.rows.split(",")):
        lines.append(measure(args.shape, m, gus, downs, args.sweep))
        print(json.dumps(lines[-1]), flush=True)
    jsonl.append(args.out, lines)


if __name__ == "__main__":
    main()
