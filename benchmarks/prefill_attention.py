"""Paged prefill attention kernel time on the GPU, against a baseline kernel in the same run.

    python benchmarks/prefill_attention.py [--baseline MODULE_FILE] [--out FILE]

For each model's attention shape: a 4,096-token chunk from position 0 (causal), a 512-token
chunk after 3,584 cached tokens, and the appended-turn shapes: 128- and 11-token chunks after
~4,000 (split-K), pages of 16, bf16. `--sweep` also times tile variants of the current kernel
on the 4,096-token chunk. Reports median device time (CUDA events around a CUDA graph of 20
launches, 5 repeats: an eager loop measured the host's launch cost for the short chunks, ~0.2
ms per call on one machine) and the achieved TFLOP/s counting only the causal half of the
products.
`--baseline` names another copy of prep/components/triton_attention.py (e.g. the previous
revision) to time side by side; with `--decode` it may be a copy of triton_decode.py.
`--decode` also times the paged decode kernels (one query token per row, batches 1 and 4, 640
/ 4,096 / 16,384 keys of context, the achieved rate counted as the K and V bytes read), and a
decode layer's attention as launched: KV write, partials and merge kernel / merge by the last
split program / one launch that also writes the new token / that with programmatic dependent
launch. `--sdpa` times chunks from position 0
through torch's attention backends (cuDNN, FlashAttention, memory-efficient) against it;
`--own-keys` a prompt's first chunk as a layer runs it from the q|k|v output, through the
paged op and through the own-keys op of `prefill_fresh` (and the baseline's own-keys op).
`--splits` times an agent turn's chunk (384 tokens after 4,906 cached) at split-K counts 1-8,
marking the count the kernel picks. Prints JSON lines, then a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jsonl

# name: (query heads, kv heads, head dim)
SHAPES = {
    "qwen3-1.7b": (16, 8, 128),
    "qwen3-8b": (32, 8, 128),
    "qwen3.5-2b": (8, 2, 256),
    "qwen3.5-9b": (16, 4, 256),
}


def _load(path: Path):
    """The baseline module, its custom ops renamed (one name dispatches to one registration)."""
    import types

    mod = types.ModuleType(f"attn_{path.stem}")
    code = path.read_text().replace('"flare::', '"flare_baseline::')
    exec(compile(code, str(path), "exec"), mod.__dict__)
    return mod


def _time_ms(fn, launches: int = 20, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(launches):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / launches)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--splits", action="store_true", help="split-K counts of an appended turn")
    ap.add_argument("--sdpa", action="store_true", help="torch's attention backends, causal chunks")
    ap.add_argument("--own-keys", action="store_true", help="a prompt's first chunk, both ops")
    args = ap.parse_args()
    from prep.components import triton_attention as current

    kernels = {"current": current.prefill_attention}
    decoders = {"current": current.decode_attention}
    if args.baseline:
        base = _load(args.baseline)  # triton_attention.py or triton_decode.py
        if hasattr(base, "prefill_attention"):
            kernels["baseline"] = base.prefill_attention
        decoders["baseline"] = base.decode_attention
    if args.decode:
        _decode(decoders, args.out)
        _decode_launches(current, args.out)
    if args.splits:
        _splits(current, args.out)
    if args.own_keys:
        _own_keys(current, _load(args.baseline) if args.baseline else None, args.out)
    if args.sdpa:
        _sdpa(current, args.out)
    if args.own_keys or args.sdpa:
        return
    ps, dev = 16, "cuda"
    rows = []
    for shape, (hq, hkv, d) in SHAPES.items():
        ctx = 4096
        n = ctx // ps
        kc = torch.randn(n + 1, ps, hkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(n, device=dev)[None]
        for start, t in ((0, 4096), (3584, 512), (3968, 128), (4085, 11)):
            pos = torch.arange(start, start + t, device=dev)
            q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
            # causal products: sum over queries of visible keys, 2 GEMMs of 2*D flops each
            visible = sum(p + 1 for p in range(start, start + t))
            flops = 4 * visible * d * hq
            ref = None
            for name, fn in kernels.items():
                out = fn(q, kc, vc, table, pos, d**-0.5)
                if ref is None:
                    ref = out.float()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                call = (q, kc, vc, table, pos, d**-0.5)
                ms = _graph_time_ms(lambda fn=fn, call=call: fn(*call))
                rec = dict(kind="prefill_attention", shape=shape, kernel=name, start=start,
                           tokens=t, ms=ms, tflops=flops / ms / 1e9, rel_err_vs_current=err)  # fmt: skip
                rows.append(rec)
                print(json.dumps(rec), flush=True)
                jsonl.append(args.out, [rec])
            if args.sweep and start == 0:
                rows += _sweep(current, shape, q, kc, vc, table, pos, flops, args.out)
    print("\n| shape | chunk | kernel | ms | TFLOP/s |")
    for r in rows:
        print(f"| {r['shape']} | {r['start']}+{r['tokens']} | {r['kernel']} | {r['ms']:.3f} "
              f"| {r['tflops']:.0f} |")  # fmt: skip


def _sdpa(current, out_path) -> None:
    """A chunk from position 0 (the keys are the chunk's own) through torch's scaled dot-product
    attention backends (cuDNN, FlashAttention, memory-efficient) over the [T, H, D] tensors as
    strided views, against the paged kernel on the same queries, keys and values. GQA: the
    backend's own (`enable_gqa`) or the key and value heads repeated (timed apart, `expand_ms`)."""
    dev = dict(kind="device", name=torch.cuda.get_device_name())
    print(json.dumps(dev), flush=True)
    jsonl.append(out_path, [dev])
    for shape, (hq, hkv, d) in SHAPES.items():
        for t in (1024, 4096, 8192):
            recs = _sdpa_case(current, shape, hq, hkv, d, t)
            for rec in recs:
                print(json.dumps(rec), flush=True)
            jsonl.append(out_path, recs)


def _own_keys(current, base, out_path) -> None:
    """A chunk that starts its prompt, as a layer runs it from the q|k|v output: the paged op
    (KV write rotating the keys, the attention rotating the queries) against the own-keys op
    (the KV write, both heads rotated into buffers, cuDNN's attention), bf16, pages of 64; with
    --baseline also the baseline module's own-keys op."""
    ps, dev = 64, "cuda"
    for shape, (hq, hkv, d) in SHAPES.items():
        for t in (2048, 4096, 8192):
            n = t // ps + 1
            kc = torch.zeros(n + 1, ps, hkv, d, device=dev, dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            table = torch.randperm(n, device=dev)[None]
            pos = torch.arange(t, device=dev)
            slots = table[0, pos // ps] * ps + pos % ps
            qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
            qn = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
            inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
            emb = torch.cat([pos[:, None].float() * inv[None, :]] * 2, dim=-1)
            cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
            common = (d**-0.5, slots, hq, qn, qn, 1e-6, 1e-6, cos, sin)

            def paged(qkv=qkv, kc=kc, vc=vc, table=table, pos=pos, common=common):
                return current.prefill_attention_from_qkv(qkv, kc, vc, table, pos, *common)

            def own(qkv=qkv, kc=kc, vc=vc, common=common):
                return current.prefill_attention_own_keys_from_qkv(qkv, kc, vc, *common)

            ref = paged().float()
            flops = 4 * (t * (t + 1) // 2) * d * hq

            def own_base(qkv=qkv, kc=kc, vc=vc, common=common):
                return base.prefill_attention_own_keys_from_qkv(qkv, kc, vc, *common)

            recs = []
            ops = [("paged from qkv", paged), ("own keys from qkv", own)]
            if base is not None:
                ops.append(("baseline own keys from qkv", own_base))
            for name, fn in ops:
                out = fn().float()
                ms = _graph_time_ms(fn)
                recs.append(dict(kind="own_keys", shape=shape, tokens=t, kernel=name, ms=ms,
                                 tflops=flops / ms / 1e9,
                                 rel_err=((out - ref).norm() / ref.norm()).item()))  # fmt: skip
            for rec in recs:
                print(json.dumps(rec), flush=True)
            jsonl.append(out_path, recs)


def _sdpa_case(current, shape: str, hq: int, hkv: int, d: int, t: int) -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ps, dev, scale, group = 16, "cuda", d**-0.5, hq // hkv
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip
    n = t // ps
    q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kc, vc = k.view(n, ps, hkv, d), v.view(n, ps, hkv, d)
    table, pos = torch.arange(n, device=dev)[None], torch.arange(t, device=dev)
    flops = 4 * (t * (t + 1) // 2) * d * hq
    ref = current.prefill_attention(q, kc, vc, table, pos, scale).float()
    ms = _graph_time_ms(lambda: current.prefill_attention(q, kc, vc, table, pos, scale))
    recs = [dict(kind="sdpa", shape=shape, tokens=t, kernel="flare paged", ms=ms, rel_err=0.0)]
    heads = (q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2))
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    repeated = (heads[0], kr[None].transpose(1, 2), vr[None].transpose(1, 2))
    expand_ms = _graph_time_ms(
        lambda: (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    )
    for name, backend in backends.items():
        for gqa in (True, False):

            def call(args=heads if gqa else repeated, gqa=gqa, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(
                        *args, is_causal=True, scale=scale, enable_gqa=gqa
                    )

            rec = dict(kind="sdpa", shape=shape, tokens=t, kernel=name, gqa=gqa)
            try:
                out = call()[0].transpose(0, 1).float()
                rec["rel_err"] = ((out - ref).norm() / ref.norm()).item()
                rec["ms"] = _graph_time_ms(call)
                if not gqa:
                    rec["expand_ms"] = expand_ms
            except Exception as e:  # a backend that refuses the shape: say why
                rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            recs.append(rec)
    for rec in recs:
        if "ms" in rec:
            rec["tflops"] = flops / rec["ms"] / 1e9
    return recs


def _graph_time_ms(fn, launches: int = 20, repeats: int = 5) -> float:
    """Device time per call, from a CUDA graph of `launches` calls (a decode kernel's device
    time is shorter than an eager launch's host cost)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return _time_ms(graph.replay, launches=1, repeats=repeats) / launches


def _decode_inputs(b: int, ctx: int, ps: int, hq: int, hkv: int, d: int):
    """b rows of ctx keys over random pages (bf16 caches), their lengths and one query each."""
    n = b * ctx // ps
    kc = torch.randn(n + 1, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    table = torch.randperm(n, device="cuda").view(b, ctx // ps)
    lens = torch.full((b,), ctx, device="cuda")
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    return kc, vc, table, lens, q


def _decode(decoders, out_path) -> None:
    ps = 16
    for shape, (hq, hkv, d) in SHAPES.items():
        for ctx in (640, 4096, 16384):
            for b in (1, 4):
                kc, vc, table, lens, q = _decode_inputs(b, ctx, ps, hq, hkv, d)
                ref = None
                for name, fn in decoders.items():
                    out = fn(q, kc, vc, table, lens, d**-0.5)
                    ref = out.float() if ref is None else ref
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    call = (q, kc, vc, table, lens, d**-0.5)
                    ms = _graph_time_ms(lambda fn=fn, call=call: fn(*call))
                    gbs = 2 * b * ctx * hkv * d * 2 / ms / 1e6
                    rec = dict(kind="decode_attention", shape=shape, kernel=name, batch=b,
                               context=ctx, ms=ms, gb_per_s=gbs, rel_err_vs_current=err)  # fmt: skip
                    print(json.dumps(rec), flush=True)
                    jsonl.append(out_path, [rec])


def _decode_launches(ta, out_path) -> None:
    """A decode step's attention per layer as launched: the KV write, the split partials and
    their merge kernel (three launches); the merge done by the last split program (two); the
    write done by the program that reads the new token too (one); and that with programmatic
    dependent launch. Each from a CUDA graph of back-to-back layers, with its KV write."""
    from prep.components import launch

    ps, dev = 16, "cuda"

    from prep.components import triton_decode

    def three(*a):
        triton_decode.MERGE_IN_LAST_PROGRAM = False
        try:
            return two(*a)
        finally:
            triton_decode.MERGE_IN_LAST_PROGRAM = True

    def two(q, kc, vc, table, lens, scale, slots, key, value):
        ta.write_kv_triton(kc, vc, slots, key, value)
        return ta.decode_attention(q, kc, vc, table, lens, scale)

    def one(q, kc, vc, table, lens, scale, slots, key, value):
        return ta.decode_attention_writing(q, kc, vc, table, lens, scale, slots, key, value)

    variants = {"write+partial+merge": (three, False), "write+partial(merging)": (two, False),
                "one launch": (one, False), "one launch, pdl": (one, True)}  # fmt: skip
    for shape, (hq, hkv, d) in SHAPES.items():
        for ctx in (640, 4096):
            for b in (1, 4):
                kc, vc, table, lens, q = _decode_inputs(b, ctx, ps, hq, hkv, d)
                pos = lens - 1
                slots = table.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
                key = torch.randn(b, hkv, d, device=dev, dtype=torch.bfloat16)
                value = torch.randn_like(key)
                call = (q, kc, vc, table, lens, d**-0.5, slots, key, value)
                for name, (fn, pdl) in variants.items():
                    launch.set_pdl(pdl)
                    try:
                        ms = _graph_time_ms(lambda fn=fn, call=call: fn(*call))
                    finally:
                        launch.set_pdl(False)
                    rec = dict(kind="decode_attention_launches", shape=shape, variant=name,
                               batch=b, context=ctx, us=ms * 1e3)  # fmt: skip
                    print(json.dumps(rec), flush=True)
                    jsonl.append(out_path, [rec])


def _splits(current, out_path) -> None:
    """An agent turn's chunk (384 tokens after 4,906 cached, the trace's turn 10) at split-K
    counts 1-8 against the count `prefill_splits` picks: how many programs fill the GPU."""
    ps, dev, start, t = 16, "cuda", 4906, 384
    for shape, (hq, hkv, d) in SHAPES.items():
        n = -(-(start + t) // ps)
        kc = torch.randn(n + 1, ps, hkv, d, device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        table = torch.randperm(n, device=dev)[None]
        pos = torch.arange(start, start + t, device=dev)
        q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
        flops = 4 * sum(p + 1 for p in range(start, start + t)) * d * hq
        block_m = current.prefill_tiles(t, hq // hkv, d, ps)[1]
        chosen = current.prefill_splits(t, block_m, hkv)
        ref = current.prefill_attention_split(q, kc, vc, table, pos, d**-0.5, 1).float()
        for splits in (1, 2, 4, 8):
            call = (q, kc, vc, table, pos, d**-0.5, splits)
            out = current.prefill_attention_split(*call).float()
            err = ((out - ref).norm() / ref.norm()).item()
            ms = _graph_time_ms(lambda call=call: current.prefill_attention_split(*call))
            rec = dict(kind="prefill_attention_splits", shape=shape, start=start, tokens=t,
                       splits=splits, chosen=splits == chosen, ms=ms, tflops=flops / ms / 1e9,
                       rel_err_vs_unsplit=err)  # fmt: skip
            print(json.dumps(rec), flush=True)
            jsonl.append(out_path, [rec])


def _sweep(current, shape, q, kc, vc, table, pos, flops, out_path) -> list[dict]:
    t, hq, d = q.shape
    gpad = current.prefill_tiles(t, hq // kc.shape[2], d, kc.shape[1])[0]
    rows = []
    for packed in (64, 128):
        for block_n in (64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    tiles = (gpad, max(1, packed // gpad), block_n, warps)
                    call = (q, kc, vc, table, pos, d**-0.5, 1, tiles, stages)
                    try:
                        ms = _graph_time_ms(
                            lambda call=call: current.prefill_attention_split(*call)
                        )
                    except Exception as exc:  # out of shared memory or registers: skip
                        print(f"skip {packed}x{block_n} w{warps} s{stages}: {type(exc).__name__}")
                        continue
                    rec = dict(kind="prefill_attention_tiles", shape=shape, start=0, tokens=t,
                               kernel=f"rows{packed} keys{block_n} warps{warps} stages{stages}",
                               ms=ms, tflops=flops / ms / 1e9)  # fmt: skip
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
                    jsonl.append(out_path, [rec])
    return rows


if __name__ == "__main__":
    main()
