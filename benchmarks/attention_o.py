"""A one-row decode layer's attention and o projection: one launch against two, same run.

    python benchmarks/attention_o.py [--shapes qwen3-1.7b,qwen3-8b] [--contexts 640,4096]
                                     [--configs 8x16384,4x8192] [--out F]

What a lone request without a seed runs per layer (the single-row executions): the decode
attention from the q|k|v output (`decode_attention_from_qkv`: norms, RoPE, KV write, split
attention, last-program merge) and then the o product with the residual add as the register
GEMV (`skinny_folded` inside `gemv_products`), against `attention_o.decode_attention_o_from_qkv`
(both in one launch with a grid barrier between), with and without the attention's programs
warming the o weight in L2, and its two phases as two launches (what it falls back to). Each
variant runs over LAYERS copies (own o weights, pages and residuals, so the weights stream from
memory as in a step) replayed in a CUDA graph; µs per layer, medians. Also the one launch's
output against the two launches' (bf16: relative L2) and against its own phases (bitwise).
Prints JSON lines (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.skinny_gemm import time_graph
from prep.components import attention_o as ao
from prep.components import skinny_gemm
from prep.components.triton_decode import decode_attention_from_qkv

LAYERS = 28
SHAPES = {"qwen3-1.7b": (16, 8, 128, 2048), "qwen3-8b": (32, 8, 128, 4096)}  # Hq, Hkv, D, hidden
PS = 64


def _layer(hq: int, hkv: int, d: int, hidden: int, ctx: int, dev: torch.device) -> dict:
    """One layer's inputs: a row of `ctx` keys over shuffled pages, its q|k|v output, norms,
    rotary rows, o weight and residual (bf16)."""
    bf = torch.bfloat16
    pages = -(-ctx // PS)
    perm = torch.randperm(pages + 4, device=dev)[:pages]
    table = torch.full((1, pages + 1), -1, dtype=torch.int32, device=dev)
    table[0, :pages] = perm.int()
    pos = ctx - 1
    slot = (table[0, pos // PS].long() * PS + pos % PS).view(1)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    emb = torch.cat([inv, inv]) * pos
    return dict(
        qkv=torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=bf),
        k=torch.randn(pages + 5, PS, hkv, d, device=dev, dtype=bf),
        v=torch.randn(pages + 5, PS, hkv, d, device=dev, dtype=bf),
        table=table, lens=torch.tensor([ctx], dtype=torch.int32, device=dev), slot=slot,
        qn=torch.rand(d, device=dev, dtype=bf) + 0.5, kn=torch.rand(d, device=dev, dtype=bf) + 0.5,
        cos=emb.cos()[None].to(bf), sin=emb.sin()[None].to(bf),
        w=torch.randn(hidden, hq * d, device=dev, dtype=bf) / (hq * d) ** 0.5,
        res=torch.randn(1, hidden, device=dev, dtype=bf),
        wq=torch.randn((hq + 2 * hkv) * d, hidden, device=dev, dtype=bf) / hidden**0.5,
    )  # fmt: skip


def _qkv(x: dict) -> torch.Tensor:
    """The folded q|k|v product of the layer input (x["res"]) as the GEMV: what runs first."""
    with skinny_gemm.gemv_products():
        return skinny_gemm.skinny_folded(x["res"], x["wq"], True, 1e-6, False, None)


def _three(x: dict, hq: int) -> torch.Tensor:
    return _two({**x, "qkv": _qkv(x)}, hq)


def _one_after_qkv(x: dict, hq: int) -> torch.Tensor:
    return _one({**x, "qkv": _qkv(x)}, hq)


def _full(x: dict, hq: int) -> torch.Tensor:
    return ao.decode_qkv_attention_o(
        x["res"], x["wq"], 1e-6, x["k"], x["v"], x["table"], x["lens"], 0.088, x["slot"], hq,
        x["qn"], x["kn"], 1e-6, 1e-6, x["cos"], x["sin"], x["w"],
    )  # fmt: skip


def _two(x: dict, hq: int) -> torch.Tensor:
    att = decode_attention_from_qkv(
        x["qkv"], x["k"], x["v"], x["table"], x["lens"], 0.088, x["slot"], hq, x["qn"], x["kn"],
        1e-6, 1e-6, x["cos"], x["sin"], x["w"],
    )  # fmt: skip
    with skinny_gemm.gemv_products():
        return skinny_gemm.skinny_folded(att.view(1, -1), x["w"], False, 0.0, False, x["res"])


def _one(x: dict, hq: int) -> torch.Tensor:
    return ao.decode_attention_o_from_qkv(
        x["qkv"], x["k"], x["v"], x["table"], x["lens"], 0.088, x["slot"], hq, x["qn"], x["kn"],
        1e-6, 1e-6, x["cos"], x["sin"], x["w"], x["res"],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-1.7b,qwen3-8b")
    ap.add_argument("--contexts", default="640,4096")
    ap.add_argument("--configs", default="8x16384,4x8192",
                    help="WARPSxCHUNK_ELEMENTS of the one launch, each timed")  # fmt: skip
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    fits = ao._fits
    for shape in args.shapes.split(","):
        hq, hkv, d, hidden = SHAPES[shape]
        for ctx in [int(c) for c in args.contexts.split(",")]:
            layers = [_layer(hq, hkv, d, hidden, ctx, dev) for _ in range(LAYERS)]
            rec = dict(bench="attention_o", shape=shape, context=ctx, layers=LAYERS,
                       device=torch.cuda.get_device_name())  # fmt: skip

            def two(i: int, layers: list = layers, hq: int = hq) -> torch.Tensor:
                return _two(layers[i], hq)

            def one(i: int, layers: list = layers, hq: int = hq) -> torch.Tensor:
                return _one(layers[i], hq)

            rec["two_launches_us"] = time_graph(two, LAYERS, 2 * LAYERS)

            # with the q|k|v product before: three launches, the GEMV then the one launch, or
            # all of it in one launch
            def three(i: int, layers: list = layers, hq: int = hq) -> torch.Tensor:
                return _three(layers[i], hq)

            def after(i: int, layers: list = layers, hq: int = hq) -> torch.Tensor:
                return _one_after_qkv(layers[i], hq)

            def full(i: int, layers: list = layers, hq: int = hq) -> torch.Tensor:
                return _full(layers[i], hq)

            ao.NUM_WARPS, ao.CHUNK_ELEMENTS = 8, 16384
            rec["qkv_three_launches_us"] = time_graph(three, LAYERS, 2 * LAYERS)
            rec["qkv_gemv_then_one_us"] = time_graph(after, LAYERS, 2 * LAYERS)
            rec["qkv_one_launch_us"] = time_graph(full, LAYERS, 2 * LAYERS)
            want3 = _three(layers[0], hq).float()
            got3 = _full(layers[0], hq).float()
            rec["qkv_one_launch_rel_err"] = ((got3 - want3).norm() / want3.norm()).item()
            want = _two(layers[0], hq).float()
            for cfg in args.configs.split(","):
                warps, elems = (int(v) for v in cfg.split("x"))
                ao.NUM_WARPS, ao.CHUNK_ELEMENTS = warps, elems
                for warm in (0, 2):
                    ao.set_warm(warm)
                    label = f"w{warps}c{elems}" + ("_warm" if warm else "")
                    rec[f"one_{label}_us"] = time_graph(one, LAYERS, 2 * LAYERS)
                    got = _one(layers[0], hq)
                    rec[f"one_{label}_rel_err"] = ((got.float() - want).norm() / want.norm()).item()
                    ao._fits = lambda *a: False  # type: ignore[assignment]
                    try:
                        phases = _one(layers[0], hq)
                        if not warm:
                            rec[f"phases_{label}_us"] = time_graph(one, LAYERS, 2 * LAYERS)
                    finally:
                        ao._fits = fits  # type: ignore[assignment]
                    rec[f"one_{label}_bitwise_phases"] = bool(torch.equal(got, phases))
            ao.set_warm(0)
            jsonl.append(args.out, [rec])
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
