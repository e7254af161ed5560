"""GPU correctness: kernels vs the reference, bf16 forward vs Transformers, graph replay with
changing inputs, and no allocation / compilation / capture after ready. Run with `-m gpu`."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


from gpu_support import rel_l2 as _rel  # noqa: E402


@pytest.mark.parametrize("page_size", [16, 64])
def test_triton_kernels_match_reference(page_size):
    from prep.components.paged_attention import AttentionMeta, PagedKVCache, reference_attention
    from prep.components.triton_attention import decode_attention, prefill_attention

    torch.manual_seed(0)
    dev = "cuda"
    hq, hkv, d, n = 32, 8, 128, 64
    kc = torch.randn(n + 1, page_size, hkv, d, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    cache = PagedKVCache([kc], [vc], page_size)
    pt = torch.full((4, 40), -1, device=dev)
    perm = torch.randperm(n, device=dev)
    lens = [1, page_size, page_size + 1, 17 * page_size // 2]
    used = 0
    for i, length in enumerate(lens):
        k = -(-length // page_size)
        pt[i, :k] = perm[used : used + k]
        used += k
    pos = torch.tensor(lens, device=dev) - 1
    q = torch.randn(4, hq, d, device=dev, dtype=torch.bfloat16)
    meta = AttentionMeta("decode", pos * 0 - 1, pos, torch.arange(4, device=dev), pt, cache, {0: 0})
    ref = reference_attention(meta, meta.cache.k_pages[0], meta.cache.v_pages[0], q, d**-0.5, None)
    out = decode_attention(q, kc, vc, pt, pos + 1, d**-0.5)
    assert _rel(out, ref) < 1e-2
    t = 3 * page_size + 5
    positions = torch.arange(page_size - 3, page_size - 3 + t, device=dev)
    qp = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
    ptp = pt[3:4]
    meta = AttentionMeta("prefill", positions * 0 - 1, positions, positions * 0, ptp, cache, {0: 0})
    ref = reference_attention(meta, meta.cache.k_pages[0], meta.cache.v_pages[0], qp, d**-0.5, None)
    out = prefill_attention(qp, kc, vc, ptp, positions, d**-0.5)
    assert _rel(out, ref) < 1e-2


def test_decode_attention_merging_in_the_last_program_is_race_free_and_the_merge_kernel(
    monkeypatch,
):
    """The last of a (row, kv head)'s split programs merges the partials (a counter per pair,
    acquire-release, reset by the merger). Over many replays of a graph of eight back-to-back
    attentions (layers sharing the counters), with and without PDL, rows of very different
    lengths: every replay is bitwise the same launches run eagerly (a merge that read a partial
    before it was stored, or a counter left non-zero, would differ), and within one bf16
    rounding of the separate merge kernel. Not bitwise that kernel: the compiler schedules the
    same merge arithmetic differently inside the attention kernel (measured on the H200: 5 of
    131,072 outputs one bf16 step apart, at most 7.6e-6, the same in eager and graph runs; on
    an H100 one output of 1.5e-7 two steps apart, 1.9e-9)."""
    from prep.components import launch, triton_decode
    from prep.components.triton_decode import decode_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, ps, n = 32, 8, 128, 16, 600
    kc = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    vc = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([1, 70, 1000, 2399], device="cuda")  # up to 150 pages per row
    pt = torch.randperm(n, generator=g, device="cuda")[: 4 * 150].view(4, 150)
    qs = torch.empty(8, 4, hq, d, device="cuda", dtype=torch.bfloat16)
    outs = torch.empty_like(qs)

    def layers() -> None:
        for i in range(8):
            outs[i] = decode_attention(qs[i], kc, vc, pt, lens, d**-0.5)

    for pdl in (False, True):
        launch.set_pdl(pdl)
        try:
            layers()  # warm: compiles, allocates the counters outside the capture
            counters = triton_decode.merge_counters(qs.device, 4 * hkv)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layers()
            for rep in range(50):
                qs.copy_(torch.randn(qs.shape, generator=g, device="cuda"))
                graph.replay()
                got = outs.clone()
                layers()  # the same one-launch kernels, eagerly
                assert torch.equal(got, outs), (pdl, rep)
                monkeypatch.setattr(triton_decode, "MERGE_IN_LAST_PROGRAM", False)
                layers()
                monkeypatch.setattr(triton_decode, "MERGE_IN_LAST_PROGRAM", True)
                # one bf16 step, or (an output near zero, the weighted V rows cancelling) an
                # absolute 1e-6: the two merges' fp32 sums differ by ~1e-7 of the terms' scale
                torch.testing.assert_close(got, outs, rtol=2**-7, atol=1e-6)
                assert (got != outs).float().mean().item() < 1e-3, (pdl, rep)
                assert not counters.any(), "a merger left its count"
        finally:
            launch.set_pdl(False)


def test_decode_attention_warming_the_next_weight_changes_nothing_it_computes():
    """With `decode_attention_prefetch` start or end, the decode attention from q|k|v also asks
    L2 for the next product's weight: its outputs and pages are bitwise those without, eagerly
    and replayed from a graph with new inputs, and the weight is untouched."""
    from prep.components import launch
    from prep.components.triton_decode import decode_attention_from_qkv

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, ps, n = 32, 8, 128, 16, 400
    base_k = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    base_v = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([1, 64, 65, 1270], device="cuda")
    pt = torch.randperm(n, generator=g, device="cuda")[: 4 * 80].view(4, 80).contiguous()
    pos = lens - 1
    slots = pt.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
    qkv = torch.randn(4, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
    cos, sin = torch.rand(4, d, device="cuda"), torch.rand(4, d, device="cuda")
    weight = torch.randn(4096, hq * d, generator=g, device="cuda").to(torch.bfloat16)
    kept = weight.clone()

    def attend(k, v):
        return decode_attention_from_qkv(
            qkv, k, v, pt, lens, d**-0.5, slots, hq, None, None, 0.0, 0.0, cos, sin, weight
        )

    results = {}
    try:
        for where in ("off", "start", "end", "auto"):
            launch.set_attention_prefetch(where)
            k, v = base_k.clone(), base_v.clone()
            out = attend(k, v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                replayed = attend(k, v)
            qkv.mul_(-1.0)  # new inputs for the replay
            graph.replay()
            results[where] = (out.clone(), replayed.clone(), k.clone(), v.clone())
            qkv.mul_(-1.0)
    finally:
        launch.set_attention_prefetch("auto")
    off = results["off"]
    for key, got in results.items():
        for a, b in zip(got, off, strict=True):
            assert torch.equal(a, b), key
    assert not torch.equal(off[0], off[1])  # the replay saw new inputs
    assert torch.equal(weight, kept)


def test_decode_attention_writing_its_token_is_bitwise_write_then_attend():
    """One launch that writes each row's new key/value and attends (bf16 pages, GQA 4, rows
    whose token opens, ends or sits inside a key block) == write_kv_triton then
    decode_attention: the same pages and bitwise the same output."""
    from prep.components.triton_attention import (
        decode_attention,
        decode_attention_writing,
        write_kv_triton,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, ps, n = 32, 8, 128, 16, 400
    base_k = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    base_v = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([1, 64, 65, 1000, 1270], device="cuda")  # at most 80 pages per row
    pt = torch.randperm(n, generator=g, device="cuda")[: 5 * 80].view(5, 80).contiguous()
    pos = lens - 1
    slots = pt.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
    qkv = torch.randn(5, hq + 2 * hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    q = qkv[:, :hq].contiguous()
    key, value = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
    write_kv_triton(k1, v1, slots, key.contiguous(), value.contiguous())
    want = decode_attention(q, k1, v1, pt, lens, d**-0.5)
    got = decode_attention_writing(q, k2, v2, pt, lens, d**-0.5, slots, key, value)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(got, want)


def _qk_norms(g, d):
    """Transformers' Qwen3RMSNorm for q and k, weights in [0.5, 1.5), in bf16."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    qn, kn = Qwen3RMSNorm(d, eps=1e-6).cuda(), Qwen3RMSNorm(d, eps=1e-6).cuda()
    with torch.no_grad():
        qn.weight.copy_(torch.rand(d, generator=g, device="cuda") + 0.5)
        kn.weight.copy_(torch.rand(d, generator=g, device="cuda") + 0.5)
    return qn.to(torch.bfloat16), kn.to(torch.bfloat16)


def _canonical_qkv(qkv, pos, hq, hkv, d, qn, kn):
    """The canonical modules on a q|k|v output [N, W] at positions [N]: split, q/k RMSNorm,
    rotate-half RoPE (base 1e6) in bf16 -> q, k, v [N, H, D] and cos, sin [N, D]."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    heads = qkv.view(qkv.shape[0], -1, d)
    with torch.no_grad():
        q, k = qn(heads[:, :hq]), kn(heads[:, hq : hq + hkv])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # [N, H, D] with cos [N, D]
    return q, k, heads[:, hq + hkv :], cos, sin


def _decode_rows(g, hkv, d, ps=16, n=400):
    """Pages [n + 1, ps, hkv, d] of random bf16 keys and values, five rows of 1 to 1,270
    tokens over random pages -> (keys, values, lengths, page table, new positions, their
    slots)."""
    base_k = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    base_v = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    lens = torch.tensor([1, 64, 65, 1000, 1270], device="cuda")
    pt = torch.randperm(n, generator=g, device="cuda")[: 5 * 80].view(5, 80).contiguous()
    pos = lens - 1
    slots = pt.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
    return base_k, base_v, lens, pt, pos, slots


def test_decode_attention_from_qkv_matches_the_canonical_modules_in_bf16():
    """The one-launch decode attention from the q|k|v output (Qwen3's q/k RMSNorm, rotate-half
    RoPE, KV write, attention) against Transformers' own Qwen3RMSNorm and
    apply_rotary_pos_emb in bf16, then the unfused write and attention: the written keys agree
    to bf16 rounding (the kernel rounds where the modules round) and so does the output."""
    from prep.components.triton_attention import write_kv_triton
    from prep.components.triton_decode import decode_attention, decode_attention_from_qkv

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d = 32, 8, 128
    base_k, base_v, lens, pt, pos, slots = _decode_rows(g, hkv, d)
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
    qn, kn = _qk_norms(g, d)
    q, k, v, cos, sin = _canonical_qkv(qkv, pos, hq, hkv, d, qn, kn)
    k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
    write_kv_triton(k1, v1, slots, k.contiguous(), v.contiguous())
    want = decode_attention(q.contiguous(), k1, v1, pt, lens, d**-0.5)
    got = decode_attention_from_qkv(qkv, k2, v2, pt, lens, d**-0.5, slots, hq, qn.weight,
                                    kn.weight, 1e-6, 1e-6, cos, sin)  # fmt: skip
    assert torch.equal(v1, v2)
    wk1, wk2 = k1.view(-1, hkv, d)[slots], k2.view(-1, hkv, d)[slots]  # the written keys
    untouched = torch.ones(k1.shape[0] * k1.shape[1], dtype=torch.bool, device="cuda")
    untouched[slots] = False
    assert torch.equal(k1.view(-1, hkv, d)[untouched], k2.view(-1, hkv, d)[untouched])
    assert _rel(wk2, wk1) < 1e-2 and _rel(got, want) < 1e-2
    print(f"rel vs the canonical modules: keys {_rel(wk2, wk1):.1e}, output {_rel(got, want):.1e}")


def test_decode_attention_in_8_warps_or_over_32_keys_computes_what_it_did(monkeypatch):
    """The decode attention from the q|k|v output launched with PDL after the product before
    it, in CUDA graphs, as served (4 warps, 64-key blocks), in 8 warps (`aw8`) and over 32-key
    blocks (`ak32`): the pages never depend on the warps or blocks, the output to bf16
    rounding (a dot over other warps or blocks may sum in another order)."""
    from prep.components import launch, triton_decode
    from prep.components.skinny_gemm import skinny_linear

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, hidden = 32, 8, 128, 512
    base_k, base_v, lens, pt, pos, slots = _decode_rows(g, hkv, d)
    x = torch.randn(5, hidden, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn((hq + 2 * hkv) * d, hidden, generator=g, device="cuda") * 0.05).to(
        torch.bfloat16
    )
    qn, kn = _qk_norms(g, d)
    _, _, _, cos, sin = _canonical_qkv(skinny_linear(x, w), pos, hq, hkv, d, qn, kn)

    def run(warps: int, keys: int):
        monkeypatch.setattr(triton_decode, "DECODE_WARPS", warps)
        monkeypatch.setattr(triton_decode, "DECODE_KEYS_MAX", keys)
        launch.set_pdl(True, "end")
        k, v = base_k.clone(), base_v.clone()
        try:

            def step():
                qkv = skinny_linear(x, w)  # the product it waits on, PDL-launched
                return triton_decode.decode_attention_from_qkv(
                    qkv, k, v, pt, lens, d**-0.5, slots, hq, qn.weight, kn.weight, 1e-6, 1e-6,
                    cos, sin,
                )  # fmt: skip

            step()  # compiled and warmed before the capture
            torch.cuda.synchronize()
            k.copy_(base_k), v.copy_(base_v)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = step()
            k.copy_(base_k), v.copy_(base_v)
            graph.replay()
            torch.cuda.synchronize()
            return out.clone(), k, v
        finally:
            launch.set_pdl(False, "after_wait")

    served, k0, v0 = run(4, 64)
    for warps, keys in ((8, 64), (4, 32)):
        plain, kp, vp = run(warps, keys)
        assert torch.equal(kp, k0) and torch.equal(vp, v0)
        assert _rel(plain, served) < 1e-2, (warps, keys, _rel(plain, served))
        print(f"{warps} warps, {keys} keys: rel {_rel(plain, served):.1e} against the served")


def test_prefill_attention_from_qkv_matches_the_canonical_modules_in_bf16():
    """A prefill chunk's attention from the q|k|v output (Qwen3's q/k RMSNorm and rotate-half
    RoPE inside the KV write and the attention) against Transformers' Qwen3RMSNorm and
    apply_rotary_pos_emb in bf16, then the unfused write and attention: a 1,000-token chunk at
    position 0 and a 200-token chunk after 3,000 keys."""
    from prep.components.triton_attention import (
        prefill_attention,
        prefill_attention_from_qkv,
        write_kv_triton,
    )  # fmt: skip

    g = torch.Generator(device="cuda").manual_seed(1)
    hq, hkv, d, ps, n = 32, 8, 128, 64, 80
    qn, kn = _qk_norms(g, d)
    for start, t in ((0, 1000), (3000, 200)):
        base_k = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
        base_v = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
        pt = torch.randperm(n, generator=g, device="cuda")[None, : n - 1].contiguous()
        pos = torch.arange(start, start + t, device="cuda")
        slots = pt[0, pos // ps] * ps + pos % ps
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
        q, k, v, cos, sin = _canonical_qkv(qkv, pos, hq, hkv, d, qn, kn)
        k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
        write_kv_triton(k1, v1, slots, k.contiguous(), v.contiguous())
        want = prefill_attention(q.contiguous(), k1, v1, pt, pos, d**-0.5)
        got = prefill_attention_from_qkv(qkv, k2, v2, pt, pos, d**-0.5, slots, hq, qn.weight,
                                         kn.weight, 1e-6, 1e-6, cos, sin)  # fmt: skip
        assert torch.equal(v1, v2)
        assert _rel(k2.float(), k1.float()) < 1e-2 and _rel(got, want) < 1e-2, (start, t)
        print(f"{start}+{t}: keys {_rel(k2.float(), k1.float()):.1e}, out {_rel(got, want):.1e}")


@pytest.mark.parametrize("shape", ["8b", "tiny-128", "tiny-256", "tiny-full"])
def test_prefill_attention_over_own_keys_matches_the_paged_op_in_bf16_and_replays(shape):
    """A chunk that starts its prompt (Qwen3-8B's attention shape; 4,000 tokens then padding
    to 4,096, as the runner stages them) through prefill_attention_own_keys_from_qkv (the
    rotated heads and cuDNN's attention) against prefill_attention_from_qkv (the paged
    kernel): the same pages, the chunk's rows within bf16 rounding of each other, and a CUDA
    graph of it replays bitwise what it computed eagerly, with other inputs."""
    from prep.components.triton_attention import (
        prefill_attention_from_qkv,
        prefill_attention_own_keys_from_qkv,
    )  # fmt: skip

    g = torch.Generator(device="cuda").manual_seed(3)
    hq, hkv, d, ps, cap, t = {
        "8b": (32, 8, 128, 64, 4096, 4000), "tiny-128": (8, 2, 32, 16, 128, 126),
        "tiny-256": (8, 2, 32, 16, 256, 250), "tiny-full": (8, 2, 32, 16, 256, 256),
    }[shape]  # fmt: skip
    qn, kn = _qk_norms(g, d)
    n = cap // ps + 2
    base_k = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    base_v = torch.randn(n + 1, ps, hkv, d, generator=g, device="cuda").to(torch.bfloat16)
    pt = torch.randperm(n, generator=g, device="cuda")[None].contiguous()
    pos = torch.cat([torch.arange(t, device="cuda"), torch.zeros(cap - t, device="cuda").long()])
    slots = pt[0, pos // ps] * ps + pos % ps
    slots[t:] = -1
    qkv = torch.randn(cap, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
    _, _, _, cos, sin = _canonical_qkv(qkv, pos, hq, hkv, d, qn, kn)
    k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
    args = (d**-0.5, slots, hq, qn.weight, kn.weight, 1e-6, 1e-6, cos, sin)
    want = prefill_attention_from_qkv(qkv, k1, v1, pt, pos, *args)
    got = prefill_attention_own_keys_from_qkv(qkv, k2, v2, *args)
    # the same pages but the trash one (the padding rows race for its slot)
    assert torch.equal(k1[:-1], k2[:-1]) and torch.equal(v1[:-1], v2[:-1])
    err = _rel(got[:t], want[:t])
    rows = [f"{_rel(got[i], want[i]):.0e}" for i in (0, 1, t // 2, t - 2, t - 1)]
    print(f"own keys against paged, {shape}: {err:.1e}; rows 0, 1, mid, -2, -1: {rows}")
    cq, ck, cv, _, _ = _canonical_qkv(qkv, pos, hq, hkv, d, qn, kn)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x[:t].float().transpose(0, 1)[None] for x in (cq, ck, cv)), is_causal=True,
        scale=d**-0.5, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    print(f"{shape}: against fp32 math on the canonical heads: own keys "
          f"{_rel(got[:t].float(), ref):.1e}, paged {_rel(want[:t].float(), ref):.1e}")  # fmt: skip
    assert _rel(got[:t].float(), ref) < 1e-2
    assert err < 1e-2
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        prefill_attention_own_keys_from_qkv(qkv, k2, v2, *args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefill_attention_own_keys_from_qkv(qkv, k2, v2, *args)
    qkv.copy_(torch.randn(qkv.shape, generator=g, device="cuda").to(torch.bfloat16))
    graph.replay()
    replayed = out.clone()
    eager = prefill_attention_own_keys_from_qkv(qkv, k2, v2, *args)
    assert torch.equal(replayed, eager)


def _canonical_models(ckpt):
    """Transformers' model of the checkpoint in bf16 and in fp32 (the reference), eager
    attention, on the GPU."""
    from transformers import AutoModelForCausalLM

    return tuple(
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=dt, attn_implementation="eager").cuda()
        for dt in (torch.bfloat16, torch.float32)
    )


def _own_keys_chunk(g, hq, hkv, d, ps, cap, t):
    """A chunk of t tokens from position 0 padded to cap (padding rows at position 0, slots to
    the trash page), zeroed pages 1.. and the own-keys op's arguments: (qkv, k pages, v pages,
    the op's remaining arguments)."""
    n = cap // ps + 2
    kc = torch.zeros(n + 1, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    pos = torch.cat([torch.arange(t, device="cuda"), torch.zeros(cap - t, device="cuda").long()])
    slots = pos + ps  # pages 1.. in order; padding to the trash page
    slots[t:] = -1
    qkv = torch.randn(cap, (hq + 2 * hkv) * d, generator=g, device="cuda").to(torch.bfloat16)
    qn, kn = _qk_norms(g, d)
    _, _, _, cos, sin = _canonical_qkv(qkv, pos, hq, hkv, d, qn, kn)
    return qkv, kc, vc, (d**-0.5, slots, hq, qn.weight, kn.weight, 1e-6, 1e-6, cos, sin)


def _capture_in_pool(fn, pool, stream):
    """fn warmed twice on a side stream, then captured into `pool` on `stream`, as the
    runner's PreparedCall.capture does: (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    stream.wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        res = fn()
    torch.cuda.synchronize()
    return graph, res


def test_own_keys_graphs_of_two_shapes_in_one_pool_replay_what_they_compute():
    """The runner's situation at the op level: the tiny bundle's attention shape (8 query, 2
    key heads of 32) at chunks of 128 and 256, each warmed on a side stream and captured into
    ONE shared memory pool in that order, then replayed in turns with new inputs: every replay
    must equal the op run eagerly on the same inputs."""
    from prep.components.triton_attention import prefill_attention_own_keys_from_qkv as op

    g = torch.Generator(device="cuda").manual_seed(5)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    cases = []
    for cap, t in ((128, 126), (256, 250)):
        qkv, kc, vc, args = _own_keys_chunk(g, 8, 2, 32, 16, cap, t)
        graph, out = _capture_in_pool(
            lambda qkv=qkv, kc=kc, vc=vc, args=args: op(qkv, kc, vc, *args), pool, stream
        )
        cases.append((graph, out, qkv, kc, vc, args, t))
    for turn in range(3):
        for graph, out, qkv, kc, vc, args, t in cases:
            qkv.copy_(torch.randn(qkv.shape, generator=g, device="cuda").to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            replayed = out.clone()
            eager = op(qkv, kc.clone(), vc.clone(), *args)
            err = _rel(replayed[:t], eager[:t])
            print(f"turn {turn}, chunk {qkv.shape[0]}: replay against eager {err:.1e}")
            assert torch.equal(replayed[:t], eager[:t]), (turn, qkv.shape[0], err)


@pytest.mark.parametrize("shape", ["tiny", "8b"])
def test_own_keys_graph_survives_another_graph_reusing_its_pool(shape):
    """A graph of the own-keys op, then a second graph captured into the same pool that
    allocates blocks of many sizes and fills them with 0xFF bytes (NaN in bf16), as the
    runner's other executions reuse what the first graph freed at the end of its capture:
    replaying the second then the first must still give what the op computes eagerly. Fails
    if anything the first graph keeps between replays (a workspace the attention expects
    as it left it) lives in memory the pool hands out again."""
    from prep.components.triton_attention import prefill_attention_own_keys_from_qkv as op

    g = torch.Generator(device="cuda").manual_seed(9)
    dims = (8, 2, 32, 16, 256, 250) if shape == "tiny" else (32, 8, 128, 64, 4096, 4000)
    t = dims[-1]
    qkv, kc, vc, args = _own_keys_chunk(g, *dims)
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()

    def scribble():
        blocks = [torch.empty(1 << b, dtype=torch.uint8, device="cuda") for b in range(9, 29)]
        for x in blocks:
            x.fill_(0xFF)

    first, out = _capture_in_pool(lambda: op(qkv, kc, vc, *args), pool, stream)
    second, _ = _capture_in_pool(scribble, pool, stream)
    for turn in range(3):
        qkv.copy_(torch.randn(qkv.shape, generator=g, device="cuda").to(torch.bfloat16))
        second.replay()
        first.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        eager = op(qkv, kc.clone(), vc.clone(), *args)
        err = _rel(replayed[:t].float(), eager[:t].float())
        print(f"scribbled pool, {shape}, turn {turn}: replay against eager {err:.1e}")
        assert torch.equal(replayed[:t], eager[:t]), (turn, err)


@pytest.mark.parametrize("fresh, graphs", [(True, True), (True, False), (False, True)])
def test_fresh_prefill_executions_match_transformers_in_bf16(
    gpu_bundle, monkeypatch, fresh, graphs
):
    """prefill{C}_fresh in a runner with CUDA graphs (FRESH_MIN_TOKENS lowered to the tiny
    bundle's capacities): the startup check keeps both, prompts of 126 and 250 tokens start at
    position 0 and nearly fill capacities 128 and 256, so both take the own-keys attention;
    every decode step after them stays within the bf16 bound of the other forward tests."""
    from gpu_support import worst_logits_error

    from flared.runner.runner import ModelRunner, RunnerPlan
    from prep import calls

    monkeypatch.setattr(calls, "FRESH_MIN_TOKENS", 128)
    ckpt, bundle = gpu_bundle
    plan = RunnerPlan("cuda", 128, 4, compile=False, cuda_graphs=graphs,
                      attention_backend="triton", prefill_fresh=fresh)  # fmt: skip
    r = ModelRunner(bundle, plan)
    print(f"startup check: {r.fresh_check}")
    assert not r.fresh_dropped
    assert ({"prefill128_fresh", "prefill256_fresh"} <= r.calls.keys()) == fresh
    assert all((c.graph is not None) == graphs for c in r.calls.values())
    # what each fresh execution saved on the check's causal chunk (the scheduler's first-chunk
    # bonus): timed for both capacities, from 7/8 of each, never negative
    print(f"fresh bonus: {r.fresh_bonus}")
    assert sorted(r.fresh_bonus) == ([128, 256] if fresh else [])
    assert all(least == c - c // 8 and ms >= 0 for c, (least, ms) in r.fresh_bonus.items())
    hf, hf32 = _canonical_models(ckpt)
    g = torch.Generator().manual_seed(2)
    prompts = {1: torch.randint(3, 500, (126,), generator=g).tolist(),
               2: torch.randint(3, 500, (250,), generator=g).tolist()}  # fmt: skip
    pages = {1: list(range(0, 10)), 2: list(range(20, 38))}
    worst_ref, worst16 = worst_logits_error(r, hf, hf32, prompts, pages, 256, decode_steps=12)
    print(f"bf16 rel L2 vs fp32: flare {worst_ref:.2e}, transformers-bf16 {worst16:.2e}")
    assert worst_ref < max(3 * worst16, 2e-2)
    runs = {name: n for name, n in r.steps.prefill_runs.items() if n}
    want = (
        {"prefill128_fresh": 1, "prefill256_fresh": 1}
        if fresh
        else {"prefill128": 1, "prefill256": 1}
    )
    assert runs == want, runs


@pytest.mark.parametrize("n", [126, 128])
def test_fresh_prefill_writes_the_pages_the_paged_prefill_writes(gpu_bundle, monkeypatch, n):
    """One prompt of n tokens prefilled from position 0 by prefill128_fresh and by prefill128
    in two runners (no graphs) into the same pages: every layer's keys and values on the
    prompt's slots, and the last token's hidden vector, within bf16 rounding of each other.
    Localises a wrong fresh prefill to the first layer whose pages differ."""
    from flared.engine.plan import AdmitOp, PageTableWrite, PrefillOp, RequestParams, StepPlan
    from flared.runner.runner import ModelRunner, RunnerPlan
    from prep import calls

    monkeypatch.setattr(calls, "FRESH_MIN_TOKENS", 128)
    _, bundle = gpu_bundle
    prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(7)).tolist()
    got = {}
    for fresh in (False, True):
        plan = RunnerPlan("cuda", 128, 4, compile=False, cuda_graphs=False,
                          attention_backend="triton", prefill_fresh=fresh)  # fmt: skip
        r = ModelRunner(bundle, plan)
        ps = r.page_size
        pages = list(range(3, 3 + -(-n // ps)))
        writes = tuple(PageTableWrite(1, i, p) for i, p in enumerate(pages))
        slots = tuple(pages[i // ps] * ps + i % ps for i in range(n))
        admit = AdmitOp("r1", 1, tuple(prompt), RequestParams(seed=1, max_tokens=8))
        r.execute(StepPlan(0, writes, (admit,),
                           prefill=PrefillOp("r1", 1, tuple(prompt), 0, slots, True)))  # fmt: skip
        runs = {k: v for k, v in r.steps.prefill_runs.items() if v}
        idx = torch.tensor(slots, device="cuda")
        flat = [t.view(-1, *t.shape[2:])[idx].float() for t in (*r.kv.k_pages, *r.kv.v_pages)]
        got[fresh] = (runs, flat, r.state.hidden[1].float().clone())
        del r
        torch.cuda.empty_cache()
    (runs0, flat0, h0), (runs1, flat1, h1) = got[False], got[True]
    print(f"n={n}: runs {runs0} / {runs1}")
    layers = len(flat0) // 2
    errs = [_rel(a, b) for a, b in zip(flat1, flat0, strict=True)]
    print(f"n={n}: k pages rel per layer {[f'{e:.0e}' for e in errs[:layers]]}")
    print(f"n={n}: v pages rel per layer {[f'{e:.0e}' for e in errs[layers:]]}")
    print(f"n={n}: last hidden rel {_rel(h1, h0):.1e}")
    assert runs1 == {"prefill128_fresh": 1} and runs0 == {"prefill128": 1}
    assert max(errs) < 5e-2 and _rel(h1, h0) < 5e-2


@pytest.fixture(scope="module")
def gpu_bundle(tmp_path_factory):
    from gpu_support import tiny_cuda_bundle

    overrides = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    return tiny_cuda_bundle(tmp_path_factory.mktemp("gpu"), "qwen3", overrides)


@pytest.mark.parametrize("trigger", ["start", "after_wait", "end"])
def test_skinny_pdl_launches_match_plain_launches_bitwise_in_a_graph(trigger):
    """Programmatic dependent launch changes when a product starts, never what it computes:
    a graph of dependent products (each reading the previous output, the residual from two
    back) launched with PDL, at every trigger position, gives bitwise the plain launches'
    results, replay after replay with new inputs."""
    from prep.components.skinny_gemm import skinny_matmul_into

    g = torch.Generator(device="cuda").manual_seed(0)
    k = 1024
    ws = [torch.randn(k, k, generator=g, device="cuda").to(torch.bfloat16) * 0.03
          for _ in range(4)]  # fmt: skip
    for m in (1, 4, 16):
        outs = {}
        for pdl in (False, True):
            x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
            ys = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _ in ws]

            def chain(x=x, ys=ys, pdl=pdl):
                kw = dict(pdl=pdl, pdl_trigger=trigger)
                skinny_matmul_into(ys[0], x, ws[0], **kw)
                skinny_matmul_into(ys[1], ys[0], ws[1], **kw)
                skinny_matmul_into(ys[2], ys[1], ws[2], residual=ys[0], **kw)
                skinny_matmul_into(ys[3], ys[2], ws[3], eps=1e-6, folded_norm=True, **kw)

            x.copy_(torch.randn(m, k, generator=g, device="cuda"))
            chain()  # warm (compiles both variants outside the capture)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain()
            got = []
            for seed in (1, 2, 3):
                gi = torch.Generator(device="cuda").manual_seed(seed)
                x.copy_(torch.randn(m, k, generator=gi, device="cuda"))
                graph.replay()
                got.append(ys[3].clone())
            outs[pdl] = got
        for a, b in zip(outs[False], outs[True], strict=True):
            assert torch.equal(a, b), m


def test_skinny_fused_matches_the_canonical_operations_in_bf16():
    """flare::skinny_fused on the GPU (each prologue, the residual, 1..16 rows) against its
    canonical-operations reference computed in fp32 from the same bf16 inputs."""
    from prep.components.skinny_gemm import fused_reference, skinny_fused

    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    for m, n, k in ((1, 4096, 4096), (3, 1536, 2048), (16, 640, 384)):
        w, nw, res = rnd(n, k) / k**0.5, rnd(k).abs() + 0.5, rnd(m, n)
        x, gu = rnd(m, k) * 3, rnd(m, 2 * k)
        for args in ((x, nw, 1e-6, False, None), (x, nw, 1e-6, False, res),
                     (gu, None, 0.0, True, res), (x, None, 0.0, False, res)):  # fmt: skip
            a, norm_w, eps, silu, r = args
            got = skinny_fused(a, w, norm_w, eps, silu, r).float()
            ref = fused_reference(
                a.float(), w.float(), None if norm_w is None else norm_w.float(), eps, silu,
                None if r is None else r.float(),
            )  # fmt: skip
            assert _rel(got, ref) < 1e-2, (m, n, k, norm_w is not None, silu, r is not None)


def test_skinny_folded_variants_match_the_canonical_operations_in_bf16():
    """The folded decode variants on the GPU (skinny_matmul_into with folded_norm and
    silu_pairs, 1..16 rows) against the canonical RMSNorm -> projection -> SiLU * up in fp32
    from the same bf16 inputs (folding rounds W * norm weight to bf16 once)."""
    from prep.components.skinny_gemm import fold_norm, interleave_pairs, skinny_matmul_into

    g = torch.Generator(device="cuda").manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    for m, f, k in ((1, 4096, 4096), (3, 1536, 2048), (16, 640, 384)):
        x, nw = rnd(m, k) * 3, rnd(k).abs() + 0.5
        gate, up = rnd(f, k) / k**0.5, rnd(f, k) / k**0.5
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        h = nw.float() * h.to(torch.bfloat16).float()
        y = torch.empty(m, 2 * f, device="cuda", dtype=torch.bfloat16)
        skinny_matmul_into(y, x, fold_norm(torch.cat([gate, up]), nw), eps=1e-6, folded_norm=True)
        want = h @ torch.cat([gate, up]).float().T
        assert _rel(y.float(), want) < 1e-2, (m, f, k, "folded")
        y = torch.empty(m, f, device="cuda", dtype=torch.bfloat16)
        wp = fold_norm(interleave_pairs(gate, up), nw)
        skinny_matmul_into(y, x, wp, eps=1e-6, folded_norm=True, silu_pairs=True)
        want = torch.nn.functional.silu(h @ gate.float().T) * (h @ up.float().T)
        assert _rel(y.float(), want) < 1e-2, (m, f, k, "pairs")


@pytest.mark.parametrize("hidden, inter", [(2048, 6144), (256, 512), (4096, 12288)])
@pytest.mark.parametrize("config", ["default", "per_sm2_split2", "per_sm3_split4"])
def test_one_launch_mlp_is_bitwise_its_two_phases_and_the_canonical_mlp(hidden, inter, config):
    """skinny_mlp's one persistent launch (gate|up and SiLU * up, a grid-wide barrier, down):
    every replay of a graph of eight back-to-back MLPs with new inputs is bitwise the same
    launches run eagerly (a program that read the intermediate before every program stored it,
    or a barrier left unbalanced, would differ or hang); against its two phases launched
    separately within one bf16 step (the compiler may schedule the epilogue's arithmetic
    differently in the two kernels) and nearly always equal; within the canonical bf16 MLP's
    rounding; the barrier's counters end at rest. Also with more programs per SM than one
    (capped by residency) and down's K split (the split tiles' counters end at rest too)."""
    import torch.nn.functional as F

    from prep.components import launch
    from prep.components import skinny_mlp as sm

    cfg = {
        "default": sm.DEFAULT,
        "per_sm2_split2": sm.MlpConfig(per_sm=2, split2=2),
        "per_sm3_split4": sm.MlpConfig(block_n1=32, per_sm=3, split2=4),
    }[config]

    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (torch.randn(2 * inter, hidden, generator=g, device="cuda") * 0.02).bfloat16()
    down = (torch.randn(hidden, inter, generator=g, device="cuda") * 0.02).bfloat16()
    for m in (1, 4, 16):
        xs = torch.randn(8, m, hidden, generator=g, device="cuda").bfloat16()
        ys, two = torch.empty_like(xs), torch.empty_like(xs)

        def layers(persistent: bool, out: torch.Tensor, xs=xs) -> None:
            for i in range(8):
                sm.skinny_mlp_into(out[i], xs[i], gate_up, down, persistent=persistent, cfg=cfg)

        layers(True, ys)  # compiles and allocates the barrier's counters outside the capture
        layers(False, two)
        torch.testing.assert_close(ys, two, rtol=2**-7, atol=1e-6)
        assert (ys != two).float().mean().item() < 1e-3, m
        gate, up = F.linear(xs, gate_up).split(inter, dim=-1)
        want = F.linear(F.silu(gate) * up, down)
        assert _rel(ys.float(), want.float()) < 1e-2, m
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            layers(True, ys)
        for rep in range(20):
            xs.copy_(torch.randn(xs.shape, generator=g, device="cuda"))
            graph.replay()
            layers(True, two)  # the same launches, eagerly
            assert torch.equal(ys, two), (m, rep)
        sync = sm.grid_sync(torch.device("cuda", torch.cuda.current_device()))
        assert sync[1].item() == 0  # the arrival count reset for the next launch
        sms = torch.cuda.get_device_properties(xs.device).multi_processor_count
        grid = sm.GRIDS[(xs.device, cfg, hidden, inter, xs.dtype, cfg.per_sm * sms)]
        assert sms <= grid <= cfg.per_sm * sms  # capped by residency, at least one per SM
        if cfg.split2 > 1:
            counters = launch.zeroed_counters("skinny_mlp", xs.device, 1)
            assert counters is not None and not counters.any().item()


def _gemm_options(gemm: str) -> dict:
    """ "GEMM[+pdl|+pdlstart|+pdlend][+splitk][+fN][+sKIND][+drawk][+ao1|+aoqkv][+spdl]" -> the
    runner plan's / engine config's decode options (pdl: the default trigger, after the wait;
    fN: folded layers for decode steps of at most N rows, every step without; sKIND:
    decode_single_gemm KIND; drawk: candidate_draw "kernel"; ao1 / aoqkv:
    decode_single_attention "one" / "qkv"; spdl: decode_single_pdl, the one-row executions
    alone with PDL, triggered at the end as served; without it the plan's default, off)."""
    name, *flags = gemm.split("+")
    single = [f[1:] for f in flags if f in ("sfolded", "sgemv", "sfolded-gemv")]
    pdl = [f for f in flags if f.startswith("pdl")]
    trigger = {"pdl": "after_wait", "pdlstart": "start", "pdlend": "end"}[pdl[0]] if pdl else None
    rows = [int(f[1:]) for f in flags if f[0] == "f" and f[1:].isdigit()]
    return dict(
        decode_gemm=name, decode_pdl=bool(pdl), decode_pdl_trigger=trigger or "after_wait",
        decode_split_k="splitk" in flags, decode_folded_rows=rows[0] if rows else 16,
        decode_single_gemm=single[0] if single else "none",
        candidate_draw="kernel" if "drawk" in flags else "ops",
        decode_single_attention={"ao1": "one", "aoqkv": "qkv"}.get(
            next((f for f in flags if f.startswith("ao")), ""), "two"
        ),
        decode_single_pdl="spdl" in flags,
    )  # fmt: skip


@pytest.fixture
def split_k_reset(monkeypatch):
    """decode_split_k, the PDL switch and decode_gemm "gemv"'s switch are process-wide: later
    tests' direct launches must not inherit them. The tiny model's products have K = 256 / 512:
    with 64-deep K-tiles under decode_split_k they split too (at the served 256-deep tiles they
    would not)."""
    from prep.components import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "SPLIT_BLOCK_K", 64)
    yield
    from prep.components.fused import set_decode_pdl, set_decode_split_k

    set_decode_split_k(False)
    set_decode_pdl(False, "after_wait")
    skinny_gemm.set_gemv(False)
    from prep.components import sampling

    sampling.set_candidate_draw("ops")
    from prep.components.fused import set_single_attention

    set_single_attention("two")


def test_split_k_launches_replay_bitwise_stay_batch_invariant_and_match_one_program():
    """K split over programs (the last one of a tile summing the partials in split order): in
    a graph of dependent products with and without PDL, every replay is bitwise the same
    launches run eagerly (a sum that read a partial before it was stored, or a counter left
    non-zero, would differ), a row's result is bitwise the same at 1 and 16 rows, and the
    results are within bf16 rounding of the one-program-per-tile kernel."""
    from prep.components import launch
    from prep.components.skinny_gemm import (
        TileConfig,
        fold_norm,
        interleave_pairs,
        skinny_matmul_into,
    )  # fmt: skip

    g = torch.Generator(device="cuda").manual_seed(3)
    k = 2048

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    w1, w2, w3 = rnd(k, k) * 0.03, rnd(k, k) * 0.03, rnd(2 * k, k) * 0.03
    wp = fold_norm(interleave_pairs(w3[:k], w3[k:]), rnd(k).abs() + 0.5)
    split, one = TileConfig(16, 256, 4, 4, 4), TileConfig(16, 256, 4, 4, 1)
    for m in (1, 4, 16):
        x = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        ys = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(3)]

        def chain(cfg, pdl, x=x, ys=ys):
            skinny_matmul_into(ys[0], x, w1, cfg, pdl=pdl)
            skinny_matmul_into(ys[1], ys[0], w2, cfg, residual=x, pdl=pdl)
            skinny_matmul_into(ys[2], ys[1], wp, cfg, eps=1e-6, folded_norm=True,
                               silu_pairs=True, pdl=pdl)  # fmt: skip

        for pdl in (False, True):
            chain(split, pdl)  # warm: compiles, allocates the counters outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                chain(split, pdl)
            for rep in range(20):
                x.copy_(torch.randn(m, k, generator=g, device="cuda"))
                graph.replay()
                got = [y.clone() for y in ys]
                chain(split, pdl)
                assert all(torch.equal(a, b) for a, b in zip(got, ys, strict=True)), (m, pdl, rep)
                counters = launch.zeroed_counters("skinny_split_k", x.device, 1)
                assert counters is not None and not counters.any(), "a tile left its count"
                chain(one, False)
                for a, b in zip(got, ys, strict=True):
                    assert _rel(a.float(), b.float()) < 4e-3, (m, pdl, rep)
    xs = rnd(16, k)
    y16 = torch.empty(16, k, device="cuda", dtype=torch.bfloat16)
    skinny_matmul_into(y16, xs, w1, split)
    for r in (0, 7, 15):
        y1 = torch.empty(1, k, device="cuda", dtype=torch.bfloat16)
        skinny_matmul_into(y1, xs[r : r + 1], w1, split)
        assert torch.equal(y1[0], y16[r]), r


FORWARD_GEMMS = ["skinny", "fused", "folded", "folded+f1", "folded+pdl", "skinny+pdl",
                 "skinny+pdlend", "skinny+splitk", "folded+splitk", "mlp", "gemv",
                 "skinny+sfolded", "skinny+sgemv", "skinny+sfolded-gemv", "skinny+drawk",
                 "skinny+sfolded-gemv+ao1", "skinny+sfolded-gemv+aoqkv",
                 "skinny+sfolded-gemv+spdl"]  # fmt: skip


@pytest.mark.parametrize("gemm", FORWARD_GEMMS)
def test_bf16_forward_matches_transformers_and_graphs_replay(gpu_bundle, gemm, split_k_reset):
    """ "+pdl": the skinny products launched with programmatic dependent launch, replayed from
    CUDA graphs (each waits for the kernel before it only before reading activations);
    "+splitk": decode products split K over programs; "+sfolded" / "+sgemv" / "+sfolded-gemv":
    requests without a seed, each decoding alone, so the one-row executions of
    decode_single_gemm run."""
    from gpu_support import worst_logits_error

    from flared.runner.runner import ModelRunner, RunnerPlan

    ckpt, bundle = gpu_bundle
    r = ModelRunner(
        bundle,
        RunnerPlan(
            "cuda",
            128,
            4,
            compile=False,
            cuda_graphs=True,
            attention_backend="triton",
            **_gemm_options(gemm),
        ),
    )
    assert all(c.graph is not None for c in r.calls.values())
    from prep.components import launch

    # "+spdl": PDL (triggered at the end) was on only while the one-row executions warmed up
    # and were captured
    assert launch._STATE["pdl"] is ("+pdl" in gemm)
    assert launch._STATE["trigger"] == _gemm_options(gemm)["decode_pdl_trigger"]
    if "splitk" in gemm:  # the products really split (hidden 256, intermediate 512)
        from prep.components.skinny_gemm import tile_config

        assert tile_config(256, 256).split_k > 1 and tile_config(256, 512).split_k > 1
    layers = r.model.base_model.layers
    assert all(getattr(layer, "_flare_fused", False) == (gemm == "fused") for layer in layers)
    folded = gemm.startswith("folded") or "+sfolded" in gemm
    assert all(getattr(layer, "_flare_folded", False) == folded for layer in layers)
    assert all(layer.mlp.one_launch == (gemm == "mlp") for layer in layers)
    from prep.components import skinny_gemm

    assert skinny_gemm._GEMV["on"] == (gemm == "gemv")  # "+sgemv": inside its executions only
    alone = _gemm_options(gemm)["decode_single_gemm"] != "none"  # not "+splitk"'s "+s"
    assert ("decode1_single" in r.calls) == alone
    hf, hf32 = _canonical_models(ckpt)
    ps = r.page_size
    g = torch.Generator().manual_seed(1)
    prompts = {
        1: torch.randint(3, 500, (37,), generator=g).tolist(),
        2: torch.randint(3, 500, (ps * 3,), generator=g).tolist(),
    }
    pages = {1: [7, 3, 11, 20, 21], 2: [0, 1, 2, 30, 31]}
    worst_ref, worst16 = worst_logits_error(
        r, hf, hf32, prompts, pages, 256, decode_steps=12, alone=alone
    )
    print(f"bf16 rel L2 vs fp32: flare {worst_ref:.2e}, transformers-bf16 {worst16:.2e}")
    assert worst_ref < max(3 * worst16, 2e-2)


@pytest.mark.parametrize(
    "gemm",
    ["skinny", "fused", "folded", "folded+f1", "folded+pdl", "folded+splitk", "mlp", "gemv",
     "skinny+sfolded", "skinny+sgemv", "skinny+sfolded-gemv", "skinny+drawk",
     "skinny+sfolded-gemv+ao1", "skinny+sfolded-gemv+aoqkv", "skinny+sfolded-gemv+spdl"],
)  # fmt: skip
def test_no_allocation_or_compile_after_ready(gpu_bundle, gemm, split_k_reset):
    import torch._dynamo.utils as du

    from flared.llm_engine import Engine, EngineConfig, SamplingParams

    _, bundle = gpu_bundle
    cfg = EngineConfig(
        device="cuda",
        num_pages=256,
        compile="decode",
        **_gemm_options(gemm),
    )
    eng = Engine(bundle, cfg).start()
    try:
        eng.generate([5, 6, 7], max_tokens=4, sampling=SamplingParams())  # warm host paths
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()
        frames = dict(du.counters["stats"])
        import threading

        outs = {}

        def go(i):
            outs[i] = eng.generate(
                list(range(3, 3 + 10 * i + 5)),
                max_tokens=8 + i,
                ignore_eos=True,
                # odd: no seed (the last, alone at the end, runs the one-row executions)
                sampling=SamplingParams(seed=None if i % 2 else i),
            )

        ths = [threading.Thread(target=go, args=(i,)) for i in range(6)]
        [t.start() for t in ths]
        [t.join() for t in ths]
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        assert all(len(outs[i].token_ids) == 8 + i for i in range(6))
        assert after["allocation.all.allocated"] == before["allocation.all.allocated"]
        assert after["segment.all.allocated"] == before["segment.all.allocated"]
        assert dict(du.counters["stats"]) == frames
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "gemm",
    ["skinny", "folded", "gemv", "skinny+sfolded", "skinny+sgemv", "skinny+sfolded-gemv",
     "skinny+sfolded-gemv+ao1", "skinny+sfolded-gemv+aoqkv", "skinny+sfolded-gemv+spdl"],
)  # fmt: skip
def test_a_seeded_request_draws_the_same_tokens_alone_and_beside_others(
    gpu_bundle, gemm, split_k_reset
):
    """The promise behind every decode kernel's fixed arithmetic (tile configurations by shape,
    fixed attention splits, per-row sampling): on the GPU, with graphs replayed at changing
    capacities, a seeded request's tokens are the same alone and among requests of other
    lengths, seeds and sampling paths. `folded` at every step keeps it (at one row only it
    could not: prep.components.fused.set_decode_gemm); so do "+sfolded" / "+sgemv", whose
    one-row executions serve only the company without a seed."""
    import threading

    from flared.llm_engine import Engine, EngineConfig, SamplingParams

    _, bundle = gpu_bundle
    eng = Engine(bundle, EngineConfig(device="cuda", num_pages=256, **_gemm_options(gemm))).start()
    try:
        sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=4242)
        prompt = list(range(5, 45))
        alone = eng.generate(prompt, max_tokens=24, ignore_eos=True, sampling=sp).token_ids
        results: dict[int, list[int]] = {}

        def go(i: int) -> None:
            if i == 3:
                run = eng.generate(prompt, max_tokens=24, ignore_eos=True, sampling=sp)
            else:
                company = SamplingParams(seed=i if i % 3 else None, top_k=0 if i % 2 else 20)
                run = eng.generate(list(range(50 + i, 60 + 17 * i)), max_tokens=5 + 7 * i,
                                   ignore_eos=True, sampling=company)  # fmt: skip
            results[i] = run.token_ids

        threads = [threading.Thread(target=go, args=(i,)) for i in range(7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results[3] == alone
        assert all(len(results[i]) == 5 + 7 * i for i in range(7) if i != 3)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("trigger", ["end", "after_wait", "start"])
def test_one_row_steps_with_pdl_serve_what_they_serve_without_it(
    gpu_bundle, trigger, split_k_reset, monkeypatch
):
    """decode_single_pdl only changes when each kernel of the one-row executions is scheduled
    (launched while the one before it drains, waiting on it before reading its output), never
    what they compute: a request without a seed decoding alone gets the same tokens and
    bit-identical logprobs (the logits behind them), through the lean one-row execution (T = 1,
    top-k 20, top-p 0.95: the candidate path) and the full-vocabulary one (no top-k, top-p
    0.95, with logprobs), with PDL triggered at the end (served), after the wait or first
    thing, as with plain launches. Only requests without a seed run the
    one-row executions (a seed or top_k 1 asks for the batch-invariant ones), so the seeds
    the engine draws for them are made the same in both engines here: the draws then depend
    on the logits alone, and differ if a single bit of them does."""
    import itertools
    import secrets

    from flared.llm_engine import Engine, EngineConfig, SamplingParams

    _, bundle = gpu_bundle
    runs: dict[bool, list[list[tuple[int, float]]]] = {}
    for pdl in (False, True):
        drawn = itertools.count(1000)  # the engine's draws of a seed, the same in each engine
        monkeypatch.setattr(secrets, "randbits", lambda bits, drawn=drawn: next(drawn))
        cfg = EngineConfig(
            device="cuda", num_pages=256, compile="none", decode_single_gemm="folded-gemv",
            decode_single_pdl=pdl, decode_single_pdl_trigger=trigger,
        )  # fmt: skip
        eng = Engine(bundle, cfg).start()
        try:
            assert eng.runner_plan.decode_single_pdl is pdl
            runs[pdl] = []
            for i, (top_k, logprobs) in enumerate(((20, 0), (0, 2), (20, 0))):
                out = eng.generate(
                    list(range(7 + i, 40 + 29 * i)), max_tokens=20, ignore_eos=True,
                    sampling=SamplingParams(temperature=1.0, top_k=top_k, top_p=0.95),
                    logprobs=logprobs,
                )  # fmt: skip
                runs[pdl].append([(t.token_id, t.logprob) for t in out.tokens])
            served = eng.stats()["decode_steps_by_execution"]
            assert served.get("decode1_lean_single", 0) >= 2 * 19, served
            assert served.get("decode1_single", 0) >= 19, served
        finally:
            eng.shutdown()
    assert [len(r) for r in runs[True]] == [20, 20, 20]
    assert runs[True] == runs[False]
    assert any(lp != 0.0 for _, lp in runs[True][1])  # the logprobs really came back


def test_a_blocking_step_wait_serves_the_same_tokens(gpu_bundle):
    """`step_wait = "block"` only changes how the engine thread waits for a step's event (a
    sleep in the driver instead of a poll): the same seeded requests give the same tokens."""
    from flared.llm_engine import Engine, EngineConfig, SamplingParams

    _, bundle = gpu_bundle
    got = {}
    for wait in ("spin", "block"):
        eng = Engine(bundle, EngineConfig(device="cuda", num_pages=256, step_wait=wait)).start()
        try:
            sampling = [SamplingParams(seed=i) for i in range(3)]
            runs = [
                eng.generate(list(range(3, 20 + i)), max_tokens=24, ignore_eos=True, sampling=sp)
                for i, sp in enumerate(sampling)
            ]
            got[wait] = [r.token_ids for r in runs]
        finally:
            eng.shutdown()
    assert got["block"] == got["spin"]


def test_triton_topk_has_the_librarys_values_and_the_lowest_tied_indices_in_a_graph():
    """chunked_topk on CUDA (Flare's kernel: 1,024-value chunks, a middle stage of 16 chunks'
    candidates, the merge) over 151,936-token rows, captured and replayed on changed inputs:
    the library's values, the lowest indices among equal values (a stable descending sort's
    order), each row's result its own; the two-launch form gives the same."""
    from prep.components.sampling import chunked_topk

    g = torch.Generator().manual_seed(0)
    for n, k in ((1, 64), (4, 20), (8, 1), (3, 64)):
        x = torch.empty(n, 151_936, device="cuda")
        res = {}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            chunked_topk(x.normal_(), k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res["vals"], res["idx"] = chunked_topk(x, k)
        for trial in range(2):  # changed inputs, replayed
            host = torch.randn(n, 151_936, generator=g) * 3
            host[n // 2] = torch.randint(0, 50, (151_936,), generator=g).float()  # ties
            host[-1, : 151_936 // 2] = float("-inf")  # banned tokens
            x.copy_(host)
            graph.replay()
            torch.cuda.synchronize()
            vals, idx = res["vals"].cpu(), res["idx"].cpu()
            ref, _ = torch.topk(host, k, dim=-1)
            assert torch.equal(vals, ref), (n, k, trial)
            order = torch.sort(host, dim=-1, descending=True, stable=True).indices[:, :k]
            assert torch.equal(idx, order), (n, k, trial)
            alone_v, alone_i = chunked_topk(x[n - 1 :].clone(), k)
            assert torch.equal(alone_v.cpu()[0], vals[-1]) and torch.equal(
                alone_i.cpu()[0], idx[-1]
            )
        # the two launches (4,096-value chunks, no middle stage): the same values and indices
        from prep.components import triton_topk

        assert (triton_topk.CHUNK, triton_topk.GROUP) == (1024, 16)
        gv = torch.empty(n, k, device="cuda")
        gi = torch.empty(n, k, dtype=torch.int64, device="cuda")
        triton_topk.topk_into(gv, gi, x, k, 4096, group=0)
        assert torch.equal(gv.cpu(), vals) and torch.equal(gi.cpu(), idx), (n, k)
        # rows nobody asked for: zeros, the others' results as before
        want = torch.arange(n, device="cuda") % 2 == 0
        part_v, part_i = chunked_topk(x, k, want)
        w = want.cpu()
        assert torch.equal(part_v.cpu()[w], vals[w]) and torch.equal(part_i.cpu()[w], idx[w])
        assert not part_v.cpu()[~w].any() and not part_i.cpu()[~w].any()


def test_candidate_sampling_in_a_graph_keeps_what_the_cpu_path_keeps():
    """sample() compiled and replayed in a CUDA graph over a 151,936-token vocabulary: rows with
    top-k within the candidates draw the same tokens from decode{b}'s paths ("both") and
    decode{b}_lean's ("candidates"), with the candidate draw as operations and as Flare's
    kernel (candidate_draw "kernel"; these rows sit far from any rounding boundary, so the
    two draws agree), every token is in the set the CPU path keeps, and the top logprobs
    (chunked top-k) carry the library's values."""
    from prep.components import sampling
    from prep.components.sampling import RowParams, filtered_candidates, sample

    n, vocab, k = 4, 151_936, 20
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(n, vocab, generator=g) * 3
    hist = torch.zeros(n, vocab, dtype=torch.int32)
    ones = torch.ones(n)
    params = RowParams(
        temperature=ones * 0.8, top_k=torch.tensor([1, 20, 40, 64]), top_p=ones * 0.9,
        min_p=ones * 0.01, repetition_penalty=ones, presence_penalty=ones * 0,
        frequency_penalty=ones * 0, seed=torch.arange(n), counter=torch.zeros(n, dtype=torch.int64),
    )  # fmt: skip
    cpu_kept, cpu_ids = filtered_candidates(logits, params, 64)
    dev = RowParams(**{f: getattr(params, f).cuda() for f in params.__dataclass_fields__})
    lg, hi = logits.cuda(), hist.cuda()
    out = {}
    try:
        for paths, draw in (("both", "ops"), ("candidates", "ops"), ("both", "kernel"),
                            ("candidates", "kernel")):  # fmt: skip
            sampling.set_candidate_draw(draw)
            fn = torch.compile(
                lambda paths=paths: sample(lg, hi, dev, None, k, paths), dynamic=False
            )
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()  # compiles and warms outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                res = fn()
            graph.replay()
            torch.cuda.synchronize()
            out[paths, draw] = [t.cpu() for t in res]
            torch._dynamo.reset()  # the next draw mode traces afresh
    finally:
        sampling.set_candidate_draw("ops")
    first = out["both", "ops"][0]
    assert all(torch.equal(first, o[0]) for o in out.values()), {n: o[0] for n, o in out.items()}
    for i, token in enumerate(first.tolist()):
        assert token in set(cpu_ids[i][cpu_kept[i] > 0].tolist()), i
    ref, _ = torch.topk(torch.log_softmax(logits, -1), k, dim=-1)
    for o in out.values():
        torch.testing.assert_close(o[3], ref, rtol=1e-5, atol=1e-5)
