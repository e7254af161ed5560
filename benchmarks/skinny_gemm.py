"""Decode projections at M = 1..8 rows: cuBLAS (F.linear) vs the skinny Triton GEMM, same run.

    python benchmarks/skinny_gemm.py --shape qwen3-1.7b [--sweep]

Each op is replayed as a CUDA graph of many calls over rotating weight copies (> 2x L2), so the
times are the device time of a cold weight stream, as inside a decode step. Prints JSON lines:
median µs per call and the achieved weight bandwidth, for every (shape, M, implementation).
`--warm` keeps one copy instead (a weight that fits L2 is read from it) and times an empty
launch beside: what a small product loses to its launch, ramp and drain rather than to memory.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.shapes import SHAPES
from prep.components.skinny_gemm import (
    TileConfig,
    set_split_k,
    skinny_matmul_into,
    split_config,
    split_plan,
    tile_config,
)

ROTATE_BYTES = 256 << 20
CALLS = 64


def projections(shape: str) -> dict[str, tuple[int, int]]:
    s = SHAPES[shape]
    h, i, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return {
        "q": (q, h), "kv": (kv, h), "qkv": (q + 2 * kv, h), "o": (h, q),
        "gate": (i, h), "gate_up": (2 * i, h), "down": (h, i), "lm_head": (s["vocab_size"], h),
    }  # fmt: skip


def time_graph(fn, copies: int, calls: int = CALLS) -> float:
    """Median µs per call of fn(i) replayed in a CUDA graph of `calls` calls."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i % copies)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for i in range(calls):
            fn(i % copies)
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--sweep", action="store_true", help="try every tile configuration")
    ap.add_argument("--proj", help="comma-separated projections to time (default: all)")
    ap.add_argument(
        "--split", action="store_true",
        help="also time K split over 2 / 4 / 8 programs per tile (the last one summing the "
        "partials) for outputs of at most 8,192 rows, over block_n 16 / 32, block_k 128-512 "
        "(4 stages), and the configuration decode_split_k would pick",
    )  # fmt: skip
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--warm", action="store_true",
        help="one weight copy, so a weight that fits L2 is read from L2 (what is left is the "
        "launch, ramp and drain of the product); also times an empty launch per SM as the floor",
    )  # fmt: skip
    ap.add_argument(
        "--fused", action="store_true",
        help="time the fused decode layer's launches (RMSNorm prologue for q|k|v and gate|up, "
        "residual epilogue for o, SiLU*up prologue + residual for down) against the plain "
        "kernel at the same tiles, over a small tile sweep; and the folded variants (the norm "
        "weight folded into W with 1/rms from a pass over x before the plain K loop, for "
        "q|k|v and gate|up; SiLU(gate)*up in gate|up's epilogue from interleaved rows; down "
        "with the residual only)",
    )  # fmt: skip
    ap.add_argument(
        "--folded-only", action="store_true",
        help="with --fused: time only the plain kernel and the folded variants (a smaller sweep)",
    )  # fmt: skip
    ap.add_argument(
        "--pdl", action="store_true",
        help="time each projection, and a dense layer's four products in order, replayed back "
        "to back without programmatic dependent launch and with it at each trigger position "
        "(the first pipeline's weights prefetched into L2 before the wait for the previous "
        "kernel); with --split, at decode_split_k's tile configurations",
    )  # fmt: skip
    ap.add_argument(
        "--cublas-kernels", action="store_true",
        help="record the kernels cuBLAS launches for each projection and row count (name, "
        "grid, block, registers, shared memory, blocks per SM, from the profiler's trace) "
        "instead of timing: the tile and split choices the skinny kernel is measured against",
    )  # fmt: skip
    ap.add_argument(
        "--gemv", action="store_true",
        help="time the register GEMV (prep.components.skinny_gemv: whole weight chunks loaded "
        "into registers, CUDA-core dot products, K split over programs) over its configurations "
        "against the tile kernel's configuration and cuBLAS, for each projection and row count",
    )  # fmt: skip
    ap.add_argument(
        "--gemv-forms", default="cores,xl1,seg",
        help="with --gemv: comma-separated GemvConfig forms (cores, xl1, seg, dot)",
    )  # fmt: skip
    ap.add_argument(
        "--gemv-folded", action="store_true",
        help="the folded layers' products (q|k|v with the folded norm, o and down with the "
        "residual, gate|up with the norm and SiLU * up) as the tile kernel and as the GEMV at "
        "gemv_config, as decode_single_gemm = \"folded-gemv\" runs them",
    )  # fmt: skip
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    wanted = set(args.proj.split(",")) if args.proj else None
    if args.gemv_folded:
        jsonl.append(args.out, gemv_folded(args.shape, rows, wanted, args.warm))
        return
    if args.gemv:
        wanted = wanted or {"qkv", "o", "down"}
        jsonl.append(args.out, gemv_sweep(args.shape, rows, wanted, args.warm, args.gemv_forms))
        return
    if args.cublas_kernels:
        jsonl.append(args.out, cublas_kernels(args.shape, rows, wanted))
        return
    if args.pdl:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        set_split_k(args.split, sms)  # --split: the layer's products at decode_split_k's tiles
        jsonl.append(args.out, pdl_chains(args.shape, rows))
        return
    if args.fused:
        jsonl.append(args.out, fused_sweep(args.shape, rows, args.folded_only))
        return
    dev = torch.device("cuda")
    sweep = [
        TileConfig(bn, bk, w, st)
        for bn, bk, w, st in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4, 6))
    ]
    lines = []
    if args.warm:
        lines.append(launch_floor())
        print(json.dumps(lines[-1]), flush=True)
    for name, (n, k) in projections(args.shape).items():
        if wanted is not None and name not in wanted:
            continue
        wbytes = n * k * 2
        copies = 1 if args.warm else max(1, min(32, -(-ROTATE_BYTES // wbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, ws[0])
            impls = {
                "cublas": lambda i, x=x, y=y, ws=ws: torch.nn.functional.linear(x, ws[i], out=y)
            }
            cfgs = sweep if args.sweep else [tile_config(n, k)]
            if args.split and n <= 8192:
                cfgs = cfgs + split_configs(n, k)
            for c in cfgs:
                impls[f"skinny{c.label()}"] = lambda i, c=c, x=x, y=y, ws=ws: skinny_matmul_into(
                    y, x, ws[i], c
                )
            best: dict[str, float] = {}
            for label, fn in impls.items():
                try:
                    us = time_graph(fn, copies)
                except Exception as exc:  # a configuration the compiler rejects
                    print(f"# {name} M={m} {label}: {type(exc).__name__}", file=sys.stderr)
                    continue
                best[label] = us
            got = torch.empty_like(y)
            skinny_matmul_into(got, x, ws[0])
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            top = min((v, kk) for kk, v in best.items() if kk != "cublas")
            rec = {
                "kind": "skinny_gemm", "shape": args.shape, "proj": name, "n": n, "k": k,
                "m": m, "cublas_us": best.get("cublas"),
                "cublas_gbps": wbytes / best["cublas"] / 1e3 if "cublas" in best else None,
                "best": top[1], "best_us": top[0], "best_gbps": wbytes / top[0] / 1e3,
                "rel_err_vs_cublas": err, "warm": args.warm,
            }  # fmt: skip
            if args.split:
                split_labels = {f"skinny{c.label()}" for c in cfgs if c.split_k > 1}
                splits = [(v, kk) for kk, v in best.items() if kk in split_labels]
                if splits:
                    rec["best_split"], rec["best_split_us"] = min(splits)[1], min(splits)[0]
                plain = f"skinny{tile_config(n, k).label()}"
                rec["tile_config_us"] = best.get(plain)
                chosen = split_configs(n, k)[-1]
                picked = f"skinny{chosen.label()}"
                rec["decode_split_k"], rec["decode_split_k_us"] = picked, best.get(picked)
                skinny_matmul_into(got, x, ws[0], chosen)  # the split result, checked too
                rec["decode_split_k_rel_err_vs_cublas"] = (
                    (got.float() - ref.float()).norm() / ref.float().norm()
                ).item()
            if args.sweep or args.split:
                rec["all_us"] = {kk: round(v, 2) for kk, v in sorted(best.items())}
            lines.append(rec)
            print(json.dumps(rec), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    jsonl.append(args.out, lines)


def gemv_configs(n: int, k: int, forms: str = "cores,xl1,seg") -> list:
    """The register GEMV's configurations for an [n, k] weight: 8-32 rows (16-32 for the dot
    form), 1,024- or 2,048-column chunks, at most 256 bytes of weight per thread and chunk (two
    chunks live), K split in 1-4, for each of `forms` (comma-separated GemvConfig forms)."""
    from prep.components.skinny_gemv import GemvConfig, gemv_plan

    out = []
    for form, bn, bk, warps, split in itertools.product(
        forms.split(","), (8, 16, 32), (1024, 2048), (4, 8), (1, 2, 3, 4)
    ):
        if bn * bk * 2 > 256 * 32 * warps or bk > k or (form == "dot" and bn < 16):
            continue
        c = GemvConfig(bn, bk, warps, split, form)
        if gemv_plan(k, c)[0] == split:  # the split it asks for, not a duplicate of a smaller one
            out.append(c)
    return out


def gemv_sweep(
    shape: str, rows: list[int], wanted: set[str], warm: bool, forms: str = "cores,xl1,seg"
) -> list[dict]:
    """--gemv: per projection and row count, cuBLAS, the tile kernel's configuration and every
    register-GEMV configuration (cold weights unless `warm`), with the best GEMV's error."""
    from prep.components.skinny_gemv import gemv_into

    dev = torch.device("cuda")
    lines = []
    for name, (n, k) in projections(shape).items():
        if name not in wanted:
            continue
        wbytes = n * k * 2
        copies = 1 if warm else max(1, min(32, -(-ROTATE_BYTES // wbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        cfgs = gemv_configs(n, k, forms)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, ws[0]).float()
            times = {
                "cublas": time_graph(
                    lambda i, x=x, y=y, ws=ws: torch.nn.functional.linear(x, ws[i], out=y), copies
                ),
                "tile": time_graph(
                    lambda i, x=x, y=y, ws=ws: skinny_matmul_into(y, x, ws[i]), copies
                ),
            }
            errs = {}
            for c in cfgs:
                try:
                    gemv_into(y, x, ws[0], c)
                    errs[c.label()] = ((y.float() - ref).norm() / ref.norm()).item()
                    times[c.label()] = time_graph(
                        lambda i, c=c, x=x, y=y, ws=ws: gemv_into(y, x, ws[i], c), copies
                    )
                except Exception as exc:  # a configuration the compiler rejects
                    print(f"# {name} M={m} {c.label()}: {type(exc).__name__}: {exc}"[:300],
                          file=sys.stderr)  # fmt: skip
            best = min((v, kk) for kk, v in times.items() if kk.startswith("gemv"))
            rec = {
                "kind": "skinny_gemv", "shape": shape, "proj": name, "n": n, "k": k, "m": m,
                "warm": warm, "cublas_us": times["cublas"], "tile_us": times["tile"],
                "tile": tile_config(n, k).label(), "best_gemv": best[1], "best_gemv_us": best[0],
                "best_gemv_gbps": wbytes / best[0] / 1e3,
                "best_gemv_rel_err_vs_cublas": errs[best[1]],
                "max_gemv_rel_err_vs_cublas": max(errs.values()),
                "all_us": {kk: round(v, 2) for kk, v in sorted(times.items())},
                "device": torch.cuda.get_device_name(0),
            }  # fmt: skip
            lines.append(rec)
            print(json.dumps(rec), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return lines


def gemv_folded(shape: str, rows: list[int], wanted: set[str] | None, warm: bool) -> list[dict]:
    """--gemv-folded: each folded-layer product (its epilogue) as the tile kernel and as the
    GEMV at `skinny_gemv.gemv_config` (products it does not cover are skipped), cold weights
    unless `warm`, with both errors against `folded_reference` in fp32."""
    from prep.components.skinny_gemm import folded_reference
    from prep.components.skinny_gemv import gemv_config, gemv_into

    dev = torch.device("cuda")
    variants = {
        "qkv": dict(eps=1e-6, folded_norm=True), "gate_up": dict(eps=1e-6, folded_norm=True,
        silu_pairs=True), "o": dict(residual=True), "down": dict(residual=True),
    }  # fmt: skip
    lines = []
    for name, (n, k) in projections(shape).items():
        cfg = gemv_config(n, k)
        if name not in variants or (wanted is not None and name not in wanted) or cfg is None:
            continue
        wbytes = n * k * 2
        copies = 1 if warm else max(1, min(32, -(-ROTATE_BYTES // wbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        for m in rows:
            v = dict(variants[name])
            pairs = bool(v.get("silu_pairs"))
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n // 2 if pairs else n, device=dev, dtype=torch.bfloat16)
            if v.pop("residual", False):
                v["residual"] = torch.randn_like(y)
            eps = v.get("eps") if v.get("folded_norm") else None
            ref = folded_reference(x.float(), ws[0].float(), eps, pairs,
                                   None if "residual" not in v else v["residual"].float())  # fmt: skip
            rec = {"kind": "gemv_folded", "shape": shape, "proj": name, "n": n, "k": k, "m": m,
                   "warm": warm, "gemv": cfg.label(), "tile": tile_config(n, k).label(),
                   "device": torch.cuda.get_device_name(0)}  # fmt: skip
            for label, run in (
                ("tile", lambda i, x=x, y=y, v=v, ws=ws: skinny_matmul_into(y, x, ws[i], **v)),
                ("gemv", lambda i, x=x, y=y, v=v, ws=ws, c=cfg: gemv_into(y, x, ws[i], c, **v)),
            ):
                run(0)
                rec[f"{label}_rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                rec[f"{label}_us"] = time_graph(run, copies)
            lines.append(rec)
            print(json.dumps(rec), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return lines


@triton.jit
def _empty(Y):
    # one store per program, so the launch is not optimised away
    tl.store(Y + tl.program_id(0), tl.program_id(0))


def launch_floor() -> dict:
    """µs of an empty launch of one program per SM (4 warps) replayed back to back in a graph:
    the part of a product's time no tile configuration can remove."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    y = torch.zeros(sms, device="cuda", dtype=torch.int32)
    us = time_graph(lambda _i: _empty[(sms,)](y), 1)
    return {"kind": "launch_floor", "programs": sms, "us": us,
            "device": torch.cuda.get_device_name(0)}  # fmt: skip


TRACE_ARGS = (
    "grid", "block", "registers per thread", "shared memory", "blocks per SM", "warps per SM",
    "est. achieved occupancy %",
)  # fmt: skip


def trace_kernels(trace: dict) -> list[dict]:
    """The device kernels of a profiler's Chrome trace, in start order: name, µs and the
    launch's TRACE_ARGS where the trace has them."""
    events = sorted(
        (e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"),
        key=lambda e: e.get("ts", 0),
    )
    out = []
    for e in events:
        a = e.get("args", {})
        out.append({"name": e.get("name", "")[:200], "us": e.get("dur"),
                    **{k: a[k] for k in TRACE_ARGS if k in a}})  # fmt: skip
    return out


def cublas_kernels(shape: str, rows: list[int], wanted: set[str] | None) -> list[dict]:
    """What F.linear launches for each projection of `shape` at each row count (one call
    profiled after three warm-up calls): `trace_kernels` of its trace."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    lines = []
    for name, (n, k) in projections(shape).items():
        if wanted is not None and name not in wanted:
            continue
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                torch.nn.functional.linear(x, w, out=y)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.nn.functional.linear(x, w, out=y)
                torch.cuda.synchronize()
            with tempfile.TemporaryDirectory() as d:
                path = Path(d) / "trace.json"
                prof.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
            rec = {"kind": "cublas_kernels", "shape": shape, "proj": name, "n": n, "k": k,
                   "m": m, "kernels": trace_kernels(trace),
                   "device": torch.cuda.get_device_name(dev)}  # fmt: skip
            lines.append(rec)
            print(json.dumps(rec), flush=True)
    return lines


def split_configs(n: int, k: int) -> list[TileConfig]:
    """--split's K-split configurations for an [n, k] weight, the one `decode_split_k` picks
    last (it may repeat one of the grid's)."""
    grid = [
        TileConfig(bn, bk, 4, st, sp)
        for bn, bk, st, sp in itertools.product((16, 32), (128, 256, 512), (4,), (2, 4, 8))
        if split_plan(k, TileConfig(bn, bk, 4, st, sp))[0] == sp
    ]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return [*grid, split_config(n, k, tile_config(n, k), sms)]


# projection -> (norm prologue, SiLU*up prologue, residual epilogue) of the fused decode layer
FUSED_CALLS = {
    "qkv": (True, False, False), "o": (False, False, True), "gate_up": (True, False, False),
    "down": (False, True, True),
}  # fmt: skip
# projection -> (folded norm, SiLU pairs epilogue, residual epilogue) of the folded variant
FOLDED_CALLS = {
    "qkv": (True, False, False), "o": (False, False, True), "gate_up": (True, True, False),
    "down": (False, False, True),
}  # fmt: skip


def fused_sweep(shape: str, rows: list[int], folded_only: bool = False) -> list[dict]:
    """Per fused launch and M: the plain kernel at its shape's tiles, the fused and folded
    variants at the same tiles and over block_k x warps x stages (best reported); with
    `folded_only` the folded variant alone, over block_k x stages at 4 warps."""
    dev = torch.device("cuda")
    out = []
    for name, (norm, silu, resid) in FUSED_CALLS.items():
        n, k = projections(shape)[name]
        wbytes = n * k * 2
        copies = max(1, min(32, -(-ROTATE_BYTES // wbytes)))
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        nw = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
        base = tile_config(n, k)
        for m in rows:
            x = torch.randn(m, 2 * k if silu else k, device=dev, dtype=torch.bfloat16)
            xp = x[:, :k].contiguous()
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            r = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
            kw = dict(norm_weight=nw if norm else None, eps=1e-6, silu_mul=silu,
                      residual=r if resid else None)  # fmt: skip

            def fused(c, x=x, y=y, kw=kw, ws=ws):
                return lambda i: skinny_matmul_into(y, x, ws[i], c, **kw)

            def plain(i, xp=xp, y=y, ws=ws, base=base):
                skinny_matmul_into(y, xp, ws[i], base)

            fnorm, pairs, fres = FOLDED_CALLS[name]
            yf = torch.empty(m, n // 2 if pairs else n, device=dev, dtype=torch.bfloat16)
            fkw = dict(eps=1e-6, folded_norm=fnorm, silu_pairs=pairs,
                       residual=r if fres else None)  # fmt: skip

            def folded(c, xp=xp, yf=yf, fkw=fkw, ws=ws):
                return lambda i: skinny_matmul_into(yf, xp, ws[i], c, **fkw)

            times = {"plain": time_graph(plain, copies)}
            if not folded_only:
                times["fused_same_tiles"] = time_graph(fused(base), copies)
            times["folded_same_tiles"] = time_graph(folded(base), copies)
            makers = [("folded", folded)] if folded_only else [("fused", fused), ("folded", folded)]
            grid = (
                itertools.product((128, 256, 512), (4,), (3, 4))
                if folded_only
                else itertools.product((64, 128, 256, 512), (4, 8), (2, 3, 4))
            )
            for bk, w, st in grid:
                c = TileConfig(base.block_n, bk, w, st)
                for label, make in makers:
                    try:
                        times[f"{label}{c.block_n}x{bk}w{w}s{st}"] = time_graph(make(c), copies)
                    except Exception as exc:  # a configuration the compiler rejects
                        print(f"# {name} M={m} {label} {c}: {type(exc).__name__}", file=sys.stderr)
            best = min(((v, kk) for kk, v in times.items() if kk.startswith("fused")),
                       default=(float("nan"), "none"))  # fmt: skip
            fbest = min((v, kk) for kk, v in times.items() if kk.startswith("folded"))
            rec = {
                "kind": "skinny_fused", "shape": shape, "proj": name, "n": n, "k": k, "m": m,
                "plain_us": times["plain"], "fused_same_tiles_us": times.get("fused_same_tiles"),
                "best": best[1], "best_us": best[0], "plain_gbps": wbytes / times["plain"] / 1e3,
                "folded_same_tiles_us": times["folded_same_tiles"], "folded_best": fbest[1],
                "folded_best_us": fbest[0],
                "all_us": {kk: round(v, 2) for kk, v in sorted(times.items())},
            }  # fmt: skip
            out.append(rec)
            print(json.dumps({kk: v for kk, v in rec.items() if kk != "all_us"}), flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return out


LAYER = ("qkv", "o", "gate_up", "down")  # a dense layer's products, in order


def pdl_chains(shape: str, rows: list[int]) -> list[dict]:
    """Per M: each projection's graph of CALLS back-to-back launches, and a graph of CALLS
    dense layers (q|k|v, o, gate|up, down over rotating weight copies, each product reading
    the previous one's output where the shapes chain), without PDL and with it at each trigger
    position (launch.py: start, after_wait, end)."""
    dev = torch.device("cuda")
    projs = projections(shape)
    out = []
    weights = {}
    for name in LAYER:
        n, k = projs[name]
        copies = max(1, min(8, -(-ROTATE_BYTES // (n * k * 2 * len(LAYER)))))
        weights[name] = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
    layer_bytes = sum(w[0].numel() * 2 for w in weights.values())
    copies = min(len(w) for w in weights.values())
    for m in rows:
        xs = {name: torch.randn(m, projs[name][1], device=dev, dtype=torch.bfloat16)
              for name in LAYER}  # fmt: skip
        ys = {name: torch.empty(m, projs[name][0], device=dev, dtype=torch.bfloat16)
              for name in LAYER}  # fmt: skip
        for trigger in (None, "start", "after_wait", "end"):
            pdl = trigger is not None
            rec: dict = {"kind": "skinny_pdl", "shape": shape, "m": m, "pdl": pdl,
                         "trigger": trigger}  # fmt: skip
            for name in LAYER:
                ws, x, y = weights[name], xs[name], ys[name]
                rec[f"{name}_us"] = time_graph(
                    lambda i, ws=ws, x=x, y=y, pdl=pdl, t=trigger: skinny_matmul_into(
                        y, x, ws[i], pdl=pdl, pdl_trigger=t
                    ),
                    len(ws),
                )

            def layer(i: int, pdl: bool = pdl, t=trigger, xs: dict = xs, ys: dict = ys) -> None:
                h = xs["qkv"]
                for name in LAYER:
                    x = h if h.shape[1] == projs[name][1] else xs[name]
                    skinny_matmul_into(ys[name], x, weights[name][i], pdl=pdl, pdl_trigger=t)
                    h = ys[name]

            rec["layer_us"] = time_graph(layer, copies)
            rec["layer_gbps"] = layer_bytes / rec["layer_us"] / 1e3
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


if __name__ == "__main__":
    main()
