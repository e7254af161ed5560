"""Does warming L2 while the memory is otherwise idle make the next decode product faster?

    python benchmarks/l2_prefetch.py [--shape qwen3-1.7b] [--rows 1,4] [--out F]

A decode step has stretches where the memory does little: the decode attention of a short row
is a latency chain (8 us a layer at ~600 keys, a few MB read), and the sampling after the head.
The product after the attention (o) streams its weight from memory right after it. This times
that product's weight stream under each way of warming its weight beforehand, same run:

    cold      the weight evicted (a 128 MiB read between repetitions), nothing warms it
    line      one `prefetch.global.L2` per 128-byte line, spread over one program per SM
    bulk      `cp.async.bulk.prefetch.L2.global`, one contiguous range per thread
    load      a plain read of the whole weight (the bound: the lines are surely in L2)

each followed by a compute-only kernel of `--idle-us` (standing in for the attention, so the
warming has time to land) and then the product. The product's time is the difference between
graphs with and without it (REPS repetitions each, medians of several replays). Prints JSON
lines: per (projection, M, mode) the product's µs, and the warming launch's own µs. With
--then P2: the first projection and then P2 in a chain, the first weight warmed whole and the
first --then-mib MiB of P2's too, against neither.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl
from benchmarks.skinny_gemm import projections, time_graph
from prep.components.skinny_gemm import skinny_matmul_into
from prep.components.triton_decode import prefetch_l2

REPS = 24
FLUSH_BYTES = 128 << 20
MODES = {"cold": 0, "line": 1, "bulk": 2, "load": 3}


@triton.jit
def _warm(W, SINK, n_words, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # W: the weight as int32 words; this program warms words [pid * per, (pid + 1) * per)
    pid = tl.program_id(0)
    per = tl.cdiv(tl.cdiv(n_words, tl.num_programs(0)), 32) * 32  # whole 128-byte lines
    lo = pid * per
    hi = tl.minimum(lo + per, n_words)
    offs = tl.arange(0, BLOCK)
    if MODE == 1:  # what the decode attention does (launch.set_attention_prefetch)
        prefetch_l2(W, n_words, pid, tl.num_programs(0), BLOCK)
    elif MODE == 2:
        # BLOCK threads' ranges of `each` words (a multiple of 4: 16 bytes) cover [lo, hi)
        each = tl.cdiv(tl.cdiv(tl.maximum(hi - lo, 0), BLOCK), 4) * 4
        start = lo + offs * each
        size = tl.maximum(tl.minimum(start + each, hi) - start, 0) * 4  # bytes
        start = tl.where(size > 0, start, lo)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [W + start, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
    elif MODE == 3:
        acc = tl.zeros([BLOCK], tl.int32)
        for start in range(lo, hi, BLOCK):
            acc ^= tl.load(W + start + offs, mask=start + offs < hi, other=0)
        tl.store(SINK + pid, tl.sum(acc, 0))


@triton.jit
def _idle(SINK, ITERS):
    # compute only: a dependent chain of multiply-adds, no memory traffic until the end
    x = tl.program_id(0).to(tl.float32) + tl.arange(0, 128).to(tl.float32)
    for _ in range(ITERS):
        x = x * 1.0000001 + 1e-7
    tl.store(SINK + tl.program_id(0) * 128 + tl.arange(0, 128), x, mask=x == -1.0)


def replay_us(fn, reps: int = REPS) -> float:
    """Median µs of one replay of a CUDA graph holding `reps` calls of fn."""
    return time_graph(lambda _i: fn(), 1, calls=reps) * reps


def time_product(
    products: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], mode: int,
    regions: list[torch.Tensor], flush: torch.Tensor, iters: int,
) -> tuple[float, float]:  # fmt: skip
    """(µs of the products y = x @ w^T in order after every weight was evicted, the int32
    `regions` warmed by `mode` and an idle launch; µs of the eviction, warming and idle
    launch alone)."""
    dev = products[0][0].device
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush_sink = torch.empty(4096, device=dev, dtype=torch.float32)
    sink = torch.zeros(sms * 128, device=dev, dtype=torch.float32)
    isink = torch.zeros(sms, device=dev, dtype=torch.int32)

    def before() -> None:
        torch.sum(flush.view(-1, 4096), dim=0, out=flush_sink)  # evicts the weights
        for words in regions:
            _warm[(sms,)](words, isink, words.numel(), MODE=mode, BLOCK=128)
        _idle[(sms,)](sink, iters)

    def with_products() -> None:
        before()
        for w, x, y in products:
            skinny_matmul_into(y, x, w)

    base = replay_us(before)
    both = replay_us(with_products)
    return (both - base) / REPS, base / REPS


def idle_iters(target_us: float, sms: int, sink: torch.Tensor) -> int:
    """_idle's ITERS for about target_us of device time (measured)."""
    probe = 4096
    us = replay_us(lambda: _idle[(sms,)](sink, probe), reps=8) / 8
    return max(1, int(probe * target_us / max(us, 1e-3)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-1.7b")
    ap.add_argument("--proj", default="o,qkv", help="projections to time (skinny_gemm's names)")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--idle-us", type=float, default=6.0)
    ap.add_argument("--then", help="also: the first --proj then this product in a chain")
    ap.add_argument("--then-mib", default="0,8,16,24", help="MiB of --then's weight warmed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.ones(FLUSH_BYTES // 4, device=dev, dtype=torch.float32)
    sink = torch.zeros(sms * 128, device=dev, dtype=torch.float32)
    iters = idle_iters(args.idle_us, sms, sink)
    projs = projections(args.shape)
    out = []
    for name in args.proj.split(","):
        n, k = projs[name]
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            rec: dict = {
                "kind": "l2_prefetch", "shape": args.shape, "proj": name, "n": n, "k": k,
                "m": m, "weight_mib": w.numel() * 2 / 2**20, "idle_us": args.idle_us,
                "device": torch.cuda.get_device_name(0),
            }  # fmt: skip
            words = w.view(torch.int32).view(-1)
            for label, mode in MODES.items():
                took, before = time_product([(w, x, y)], mode, [words], flush, iters)
                rec[f"{label}_us"] = took
                rec[f"{label}_before_us"] = before
            ref = x.float() @ w.float().t()
            rec["rel_err"] = float((y.float() - ref).norm() / ref.norm())
            rec["gain_vs_cold"] = {
                label: rec["cold_us"] / rec[f"{label}_us"] for label in MODES if label != "cold"
            }
            print(rec, flush=True)
            out.append(rec)
    if args.then:
        out += chain(args, flush, iters)
    jsonl.append(args.out, out)


def chain(args: argparse.Namespace, flush: torch.Tensor, iters: int) -> list[dict]:
    """The first of --proj, then --then's product: the first weight warmed whole and the
    first --then-mib of the second, against neither warmed."""
    dev = flush.device
    projs = projections(args.shape)
    first, second = args.proj.split(",")[0], args.then
    ws = [torch.randn(*projs[p], device=dev, dtype=torch.bfloat16) * 0.02 for p in (first, second)]
    out = []
    for m in (int(r) for r in args.rows.split(",")):
        products = [
            (w, torch.randn(m, w.shape[1], device=dev, dtype=torch.bfloat16),
             torch.empty(m, w.shape[0], device=dev, dtype=torch.bfloat16))
            for w in ws
        ]  # fmt: skip
        rec: dict = {
            "kind": "l2_prefetch_chain", "shape": args.shape, "first": first, "then": second,
            "m": m, "idle_us": args.idle_us, "device": torch.cuda.get_device_name(0),
        }  # fmt: skip
        cold, _ = time_product(products, 0, [ws[0].view(torch.int32).view(-1)], flush, iters)
        rec["cold_us"] = cold
        for mib in (int(v) for v in args.then_mib.split(",")):
            words = [ws[0].view(torch.int32).view(-1)]
            if mib:
                words.append(ws[1].view(torch.int32).view(-1)[: (mib << 20) // 4])
            took, before = time_product(products, MODES["line"], words, flush, iters)
            rec[f"line_then{mib}mib_us"] = took
            rec[f"line_then{mib}mib_before_us"] = before
        print(rec, flush=True)
        out.append(rec)
    return out


if __name__ == "__main__":
    main()
