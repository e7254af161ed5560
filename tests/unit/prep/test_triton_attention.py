"""The paged-attention Triton kernels, run by Triton's interpreter on CPU (fp32), against the
reference attention of the prepared contract.

Shapes cover what the kernels' tiling must handle: GQA groups 1, 2, 4 and 3 (padded to 4),
head dims 32 and 64, pages of 16 and 64 slots (key blocks of several pages and of one page),
chunks starting mid-page, a chunk whose last key block runs past its page table, tables with
unused (-1) entries, and short chunks. The kernels reorder the softmax sums (online softmax over
key blocks), so outputs agree to fp32 rounding: asserted 1e-5 relative L2 (measured ~1e-7).
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components.paged_attention import AttentionMeta, PagedKVCache, reference_attention
    from prep.components.triton_attention import (
        decode_attention, prefill_attention, prefill_attention_split,
    )

    torch.manual_seed(0)
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    def check_decode(kc, vc, cache, perm, hq, lens, width, what):
        # rows of the given lengths over consecutive runs of `perm`'s pages, -1 past each row
        ps, d = kc.shape[1], kc.shape[3]
        pt = torch.full((len(lens), width), -1)
        used = 0
        for i, length in enumerate(lens):
            k = -(-length // ps)
            pt[i, :k] = perm[used : used + k]
            used += k
        pos = torch.tensor(lens) - 1
        q = torch.randn(len(lens), hq, d)
        rows = torch.arange(len(lens))
        meta = AttentionMeta("decode", pos * 0 - 1, pos, rows, pt, cache, {0: 0})
        ref = reference_attention(meta, kc, vc, q, d**-0.5, None)
        out = decode_attention(q, kc, vc, pt, pos + 1, d**-0.5)
        assert rel(out, ref) < 1e-5, (what, rel(out, ref))

    for hq, hkv, d, ps in [(4, 4, 32, 16), (8, 4, 64, 16), (8, 2, 32, 64), (6, 2, 32, 16)]:
        n = 24
        kc = torch.randn(n + 1, ps, hkv, d)
        vc = torch.randn_like(kc)
        cache = PagedKVCache([kc], [vc], ps)
        perm = torch.randperm(n)
        # prefill: positions start mid-page; the table holds exactly the pages in use + unused
        # the last chunk is short after a long history: its key blocks split over programs
        past_checked = False
        for start, t in [(ps // 2 + 1, min(3 * ps + 5, 69)), (0, 7), (2 * ps - 1, 40), (330, 9)]:
            last = start + t - 1
            npages = last // ps + 1
            pt = torch.full((1, npages + 1), -1)
            pt[0, :npages] = perm[:npages]
            pos = torch.arange(start, start + t)
            q = torch.randn(t, hq, d)
            meta = AttentionMeta("prefill", pos * 0 - 1, pos, pos * 0, pt, cache, {0: 0})
            ref = reference_attention(meta, kc, vc, q, d**-0.5, None)
            out = prefill_attention(q, kc, vc, pt, pos, d**-0.5)
            e = rel(out, ref)
            assert e < 1e-5, ("prefill", hq, hkv, d, ps, start, t, e)
            for splits in (1, 4) if start > 2 * ps else ():  # split-K or not, the same attention
                out_s = prefill_attention_split(q, kc, vc, pt, pos, d**-0.5, splits)
                assert rel(out_s, ref) < 1e-5, ("split", splits, hq, hkv, d, ps, start, t)
            # exactly-sized table (no spare entry) whose pages end inside a 128-key block: the
            # tail block runs past the table; once per shape
            if (npages * ps) % 128 and not past_checked:
                past_checked = True
                out2 = prefill_attention(q, kc, vc, pt[:, :npages].contiguous(), pos, d**-0.5)
                assert rel(out2, ref) < 1e-5
        # decode: 3 rows of different lengths
        check_decode(kc, vc, cache, perm, hq, [1, ps + 3, 5 * ps], 8, ("decode", hq, hkv, d, ps))
    # decode rows longer than SPLITS key blocks: every split runs several blocks, the last
    # one partial, across scattered pages
    hq, hkv, d, ps = 8, 2, 32, 16
    n = 200
    kc = torch.randn(n + 1, ps, hkv, d)
    vc = torch.randn_like(kc)
    cache = PagedKVCache([kc], [vc], ps)
    perm = torch.randperm(n)
    check_decode(kc, vc, cache, perm, hq, [1100, 1024 + 1, 64 * 16], 72, "long decode")
    print("ok")
    """
)


@pytest.mark.slow
def test_attention_kernels_interpreted_match_reference():
    run_interpreted(SCRIPT, timeout_s=600)


WRITE_SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components.paged_attention import write_kv_pages
    from prep.components.triton_attention import write_kv_triton, write_tokens_per_program

    torch.manual_seed(0)
    # kv heads 3 (padded to 4 in the kernel) and 2, head dims 32 and 64, pages of 16: chunks
    # of 1, 5 and 37 tokens (several programs, a ragged last one), key/value as strided views
    # of a fused projection, negative slots (padding) going to the trash page; fp32 and bf16
    # (the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest: same-dtype only)
    for hkv, d, dtype in [(3, 32, torch.float32), (2, 64, torch.bfloat16)]:
        for t in (1, 5, 37):
            n, ps = 9, 16
            qkv = torch.randn(t, 4 * hkv, d).to(dtype)
            key, value = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv : 3 * hkv]
            slots = torch.randperm(n * ps)[:t]
            slots[::4] = -1
            base = torch.randn(n + 1, ps, hkv, d).to(dtype)
            pages = [base.clone() for _ in range(4)]
            write_kv_triton(pages[0], pages[1], slots, key, value)
            write_kv_pages(pages[2], pages[3], slots, key, value)
            assert torch.equal(pages[0], pages[2]) and torch.equal(pages[1], pages[3]), (hkv, d, t)
            hpad = 1 << (hkv - 1).bit_length()
            assert write_tokens_per_program(hkv, d) * hpad * d == 4096  # 32 here: 2 programs at 37
    print("ok")
    """
)


def test_kv_write_kernel_interpreted_matches_the_reference_scatter():
    """Exact: the kernel and index_copy_ store the same converted values at the same slots
    (the trash page included), whatever the tokens per program."""
    run_interpreted(WRITE_SCRIPT, timeout_s=300)


# rows of the given lengths over consecutive runs of a random permutation of n pages (-1 past
# each row), their lengths, and the slot of each row's last position: a decode step's metadata
PAGED_ROWS_IMPORTS = "import torch\n"
PAGED_ROWS = textwrap.dedent(
    """
    def paged_rows(lens, ps, n):
        width = max(-(-x // ps) for x in lens) + 1
        pt = torch.full((len(lens), width), -1)
        perm = torch.randperm(n)
        used = 0
        for i, length in enumerate(lens):
            k = -(-length // ps)
            pt[i, :k] = perm[used : used + k]
            used += k
        seq = torch.tensor(lens)
        pos = seq - 1
        return pt, seq, pt.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
    """
)


FUSED_WRITE_SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import triton_decode as ta
    from prep.components.paged_attention import write_kv_pages

    torch.manual_seed(0)
    # a decode step's write and attention in one launch == the scatter, then the attention:
    # the same pages (trash included) and bitwise the same output; rows whose new token opens
    # a key block, ends one, sits mid-block, is the first of the row, spans a key block longer
    # than the splits cover once; a padding row (negative slot, its stale length kept);
    # key/value as strided views of a fused projection; GQA 4 and 1; merged by the last
    # program and by the merge kernel
    for hq, hkv, d, ps in [(8, 2, 32, 16), (4, 4, 32, 64)]:
        n = 120
        lens = [1, 64, 65, 100, 64 * 16 + 1, 37]
        b = len(lens)
        pt, seq, slots = paged_rows(lens, ps, n)
        slots[-1] = -1  # padding: writes nothing but the trash page
        qkv = torch.randn(b, hq + 2 * hkv, d)
        q = qkv[:, :hq].contiguous()
        key, value = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
        base_k, base_v = torch.randn(n + 1, ps, hkv, d), torch.randn(n + 1, ps, hkv, d)
        # (merged by the last program, at most 32 keys a block: within a 64-slot page)
        for last, keys in ((True, None), (False, None), (True, 32)):
            ta.MERGE_IN_LAST_PROGRAM = last
            ta.DECODE_KEYS_MAX = keys
            k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
            write_kv_pages(k1, v1, slots, key, value)
            want = ta.decode_attention(q, k1, v1, pt, seq, d**-0.5)
            got = ta.decode_attention_writing(q, k2, v2, pt, seq, d**-0.5, slots, key, value)
            what = (hq, hkv, last, keys)
            assert torch.equal(k1, k2) and torch.equal(v1, v2), what
            assert torch.equal(got[:-1], want[:-1]), what
    ta.MERGE_IN_LAST_PROGRAM = True
    ta.DECODE_KEYS_MAX = None
    print("ok")
    """
)


@pytest.mark.slow
def test_decode_attention_writing_its_token_interpreted_equals_write_then_attend():
    """Bitwise: one launch that writes each row's new key/value and attends over them gives
    the scatter's pages and the unfused attention's output (padding row's output aside: its
    stale length attends to pages it never wrote)."""
    run_interpreted(PAGED_ROWS_IMPORTS + PAGED_ROWS + FUSED_WRITE_SCRIPT, timeout_s=600)


FROM_QKV_SCRIPT = textwrap.dedent(
    """
    import torch
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    from prep.components import triton_attention as ta
    from prep.components.paged_attention import write_kv_pages

    torch.manual_seed(0)
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # the q|k|v output -> q/k RMSNorm (or none), rotary embedding, KV write, attention in one
    # launch, against the canonical operations (fp32: the kernel's sum of squares and rotation
    # reorder fp32 roundings only)
    for hq, hkv, d, ps, norm in [(8, 2, 32, 16, True), (4, 4, 64, 64, False)]:
        n = 100
        lens = [1, 64, 65, 300, 64 * 16 + 3]  # the last: its new key past the first block
        b = len(lens)
        pt, seq, slots = paged_rows(lens, ps, n)
        pos = seq - 1
        qkv = torch.randn(b, (hq + 2 * hkv) * d)
        qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        freqs = pos[:, None].float() * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos(), emb.sin()
        base_k, base_v = torch.randn(n + 1, ps, hkv, d), torch.randn(n + 1, ps, hkv, d)
        # canonical: split, per-head RMSNorm (weight * normed), rotate-half RoPE, write, attend
        heads = qkv.view(b, -1, d)
        q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
        def rms(x, w):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * h
        if norm:
            q, k = rms(q, qn), rms(k, kn)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)  # [B, H, D] with cos [B, D] -> [B, 1, D]
        q, k = q.contiguous(), k.contiguous()
        k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
        write_kv_pages(k1, v1, slots, k, v.contiguous())
        want = ta.decode_attention(q, k1, v1, pt, seq, d**-0.5)
        got = ta.decode_attention_from_qkv(
            qkv, k2, v2, pt, seq, d**-0.5, slots, hq, qn if norm else None,
            kn if norm else None, 1e-6, 1e-6, cos, sin,
        )
        assert rel(k2, k1) < 1e-6 and torch.equal(v1, v2), (hq, hkv, norm, rel(k2, k1))
        assert rel(got, want) < 1e-5, (hq, hkv, norm, rel(got, want))
    print("ok")
    """
)


@pytest.mark.slow
def test_decode_attention_from_the_qkv_output_interpreted_matches_the_canonical_steps():
    """One launch from the q|k|v projection's output (q/k norms, rotate-half RoPE, KV write,
    attention) against the canonical modules' operations then the unfused kernels: the pages
    and the output agree to fp32 rounding."""
    run_interpreted(PAGED_ROWS_IMPORTS + PAGED_ROWS + FROM_QKV_SCRIPT, timeout_s=600)


# the q|k|v scripts' common start: the canonical q/k norm and rotary embedding to compare with
QKV_PREAMBLE = textwrap.dedent(
    """
    import torch
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
    from prep.components import triton_attention as ta

    torch.manual_seed(0)
    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    def rms(x, w):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h
    """
)

PREFILL_FROM_QKV_SCRIPT = QKV_PREAMBLE + textwrap.dedent(
    """
    from prep.components.paged_attention import write_kv_pages

    # a prefill chunk from the q|k|v output (keys normed and rotated in the KV write, queries
    # in the attention's load) against the canonical split, norms, RoPE, the scatter and the
    # attention kernel: the pages and the output agree to fp32 rounding. Chunks that start
    # mid-page after a history, at 0, short after a long history (split key blocks); slots of
    # a padded tail that go to the trash page; with and without q/k norms; GQA 4 and 1
    for hq, hkv, d, ps, norm in [(8, 2, 32, 16, True), (4, 4, 64, 16, False)]:
        n = 40
        for start, t in [(ps // 2 + 1, 37), (0, 9), (330, 7)]:
            last = start + t - 1
            npages = last // ps + 1
            pt = torch.full((1, npages + 1), -1)
            pt[0, :npages] = torch.randperm(n)[:npages]
            pos = torch.arange(start, start + t)
            slots = pt[0, pos // ps] * ps + pos % ps
            slots[-1] = -1  # a padding token: the trash page
            qkv = torch.randn(t, (hq + 2 * hkv) * d)
            qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            emb = torch.cat([pos[:, None].float() * inv[None, :]] * 2, dim=-1)
            cos, sin = emb.cos(), emb.sin()
            base_k, base_v = torch.randn(n + 1, ps, hkv, d), torch.randn(n + 1, ps, hkv, d)
            heads = qkv.view(t, -1, d)
            q, k, v = heads[:, :hq], heads[:, hq : hq + hkv], heads[:, hq + hkv :]
            if norm:
                q, k = rms(q, qn), rms(k, kn)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)  # [T, H, D], cos [T, D] -> [T, 1, D]
            k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
            write_kv_pages(k1, v1, slots, k.contiguous(), v.contiguous())
            want = ta.prefill_attention(q.contiguous(), k1, v1, pt, pos, d**-0.5)
            got = ta.prefill_attention_from_qkv(
                qkv, k2, v2, pt, pos, d**-0.5, slots, hq, qn if norm else None,
                kn if norm else None, 1e-6, 1e-6, cos, sin,
            )
            what = (hq, hkv, norm, start, t)
            assert rel(k2, k1) < 1e-6 and torch.equal(v1, v2), (what, rel(k2, k1))
            assert rel(got, want) < 1e-5, (what, rel(got, want))
    refused = 0
    for bad in (dict(cos=cos[:, :-1]), dict(k_norm=None)):
        args = dict(qkv=qkv, k_cache=k2, v_cache=v2, page_table=pt, positions=pos, scale=0.1,
                    slots=slots, num_q_heads=hq, q_norm=qn, k_norm=kn, eps_q=1e-6, eps_k=1e-6,
                    cos=cos, sin=sin)
        args.update(bad)
        try:
            ta.prefill_attention_from_qkv(**args)
        except ValueError:
            refused += 1
    assert refused == 2
    print("ok")
    """
)


@pytest.mark.slow
def test_prefill_attention_from_the_qkv_output_interpreted_matches_the_canonical_steps():
    """A prefill chunk's q/k norms and rotary embedding inside the KV write and the attention
    (reading the q|k|v output) against the canonical operations then the unfused kernels."""
    run_interpreted(PREFILL_FROM_QKV_SCRIPT, timeout_s=600)


RUNNER_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {runner_dir!r})
    from runner_harness import Harness, rel_l2
    from prep.components import triton_attention as ta

    calls = {{"from_qkv": 0, "writing": 0, "prefill_from_qkv": 0}}
    def counted(name, fn):
        def wrapper(*args):
            calls[name] += 1
            return fn(*args)
        return wrapper
    ta.decode_attention_from_qkv = counted("from_qkv", ta.decode_attention_from_qkv)
    ta.decode_attention_writing = counted("writing", ta.decode_attention_writing)
    ta.prefill_attention_from_qkv = counted("prefill_from_qkv", ta.prefill_attention_from_qkv)

    # whole decode steps through the Triton backend (fused layout: the attention from the
    # q|k|v output in one launch; canonical layout: the KV write inside the attention launch)
    # against the reference backend, fp32
    for bundle in {bundles!r}:
        tri = Harness(bundle, rows=2, attention_backend="triton")
        ref = Harness(bundle, rows=2)
        for h in (tri, ref):
            for row, n in ((1, 9), (2, 40)):
                prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(row))
                h.admit(row, prompt.tolist())
                h.prefill(row, 0, n, sample=True)
        for r in (1, 2):
            assert rel_l2(tri.logits(r), ref.logits(r)) < 1e-5, (bundle, "prefill", r)
        for step, rows in enumerate([[1], [2, 1], [1, 2], [2]]):
            forced = {{r: (step * 13 + r) % 500 + 3 for r in rows}}
            tri.decode(rows, forced=forced)
            ref.decode(rows, forced=forced)
            for r in rows:
                assert rel_l2(tri.logits(r), ref.logits(r)) < 1e-5, (bundle, step, r)
    # every decode layer took one launch: from q|k|v (fused layout), writing (canonical); the
    # four steps above and the runner's warm-up of each decode capacity; every fused-layout
    # prefill layer read the q|k|v output (the two chunks above and the warm-up's)
    layers = tri.r.model.config.num_hidden_layers
    for name, n in calls.items():
        assert n >= (2 if name.startswith("prefill") else 4) * layers and n % layers == 0, calls
    print("ok")
    """
)


@pytest.mark.slow
def test_decode_steps_through_the_triton_backend_interpreted_match_the_reference(tiny):
    """The runner with the Triton attention backend (Triton's interpreter on CPU) decodes the
    same logits as with the reference attention, in the fused layout (one attention launch
    from the q|k|v output: split, q/k norms, RoPE, KV write, attention) and the canonical one
    (the KV write inside the attention launch); warm-up steps included in the counts."""
    from pathlib import Path

    runner_dir = str(Path(__file__).resolve().parents[1] / "runner")
    # two rows and 64-token chunks: the runner's warm-up of every capacity runs interpreted too
    small = dict(max_context_tokens=128, max_prefill_chunk_tokens=64)
    bundles = [
        str(tiny.bundle("qwen3", **small)),
        str(tiny.bundle("qwen3", fused_layout=False, **small)),
    ]
    run_interpreted(RUNNER_SCRIPT.format(runner_dir=runner_dir, bundles=bundles), timeout_s=900)


FRESH_RUNNER_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    sys.path.insert(0, {runner_dir!r})
    from runner_harness import Harness, rel_l2
    from prep import calls

    # prefill{{C}}_fresh through the Triton backend (the KV write, rotated heads, torch's
    # attention over the chunk's own keys) against the reference backend's paged prefill,
    # fp32: the logits after prefill (a chunk with padding rows and a full one) and after
    # decode steps reading the pages the fresh prefill wrote
    calls.FRESH_MIN_TOKENS = 64
    tri = Harness({bundle!r}, rows=2, attention_backend="triton", prefill_fresh=True)
    ref = Harness({bundle!r}, rows=2)
    assert tri.r.fresh_check["prefill64_fresh"] < 1e-5, tri.r.fresh_check
    for h in (tri, ref):
        for row, n in ((1, 62), (2, 64)):
            prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(row))
            h.admit(row, prompt.tolist())
            h.prefill(row, 0, n, sample=True)
    for r in (1, 2):
        assert rel_l2(tri.logits(r), ref.logits(r)) < 1e-5, ("prefill", r)
    for step, rows in enumerate([[1], [2, 1]]):
        forced = {{r: (step * 13 + r) % 500 + 3 for r in rows}}
        tri.decode(rows, forced=forced)
        ref.decode(rows, forced=forced)
        for r in rows:
            assert rel_l2(tri.logits(r), ref.logits(r)) < 1e-5, (step, r)
    runs = {{k: v for k, v in tri.r.steps.prefill_runs.items() if v}}
    assert runs == {{"prefill64_fresh": 2}}, runs
    print("ok")
    """
)


@pytest.mark.slow
def test_fresh_prefills_through_the_triton_backend_interpreted_match_the_reference(tiny):
    """A runner with the Triton backend and prefill{C}_fresh (Triton's interpreter on CPU)
    prefills and then decodes the logits of the reference backend's paged path; its startup
    check finds the fresh execution agreeing and keeps it."""
    from pathlib import Path

    runner_dir = str(Path(__file__).resolve().parents[1] / "runner")
    bundle = str(tiny.bundle("qwen3", max_context_tokens=128, max_prefill_chunk_tokens=64))
    run_interpreted(FRESH_RUNNER_SCRIPT.format(runner_dir=runner_dir, bundle=bundle), timeout_s=900)


def test_outgrown_merge_counters_stay_allocated() -> None:
    """The last-program merge's counters are one buffer per device, reused by every layer and
    every captured graph. A larger batch that outgrows it gets a new one, and the old one must
    stay allocated: graphs captured before replay its address, and a freed buffer would be
    reused by the allocator while their kernels still count in it. Each owner (decode
    attention, the skinny GEMM's K splits) has its own buffer."""
    import gc
    import weakref

    pytest.importorskip("triton")
    import torch

    from prep.components import launch
    from prep.components import triton_decode as td

    dev = torch.device("cpu")
    key = ("decode_attention", dev)
    launch._COUNTERS.pop(key, None)
    first = td.merge_counters(dev, 16)
    assert first is not None and first.numel() == launch.COUNTERS_MIN
    assert bool((first == 0).all())
    assert td.merge_counters(dev, launch.COUNTERS_MIN) is first  # fits: the same buffer
    other = launch.zeroed_counters("skinny_split_k", dev, 16)
    assert other is not None and other.data_ptr() != first.data_ptr()
    ref = weakref.ref(first)
    del first
    bigger = td.merge_counters(dev, launch.COUNTERS_MIN + 1)
    assert bigger is not None and bigger.numel() == 2 * launch.COUNTERS_MIN
    gc.collect()
    assert ref() is not None, "an outgrown counter buffer was freed"
    launch._COUNTERS.pop(key, None)
    launch._COUNTERS.pop(("skinny_split_k", dev), None)


SHARED_INPUTS_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # compile this code, not a cached one
    import torch
    from torch._inductor.utils import run_and_get_code
    from prep.components import triton_attention as ta

    torch.manual_seed(0)
    # a compiled decode step of four layers whose shared inputs are computed in the graph, as
    # the prepared decode computes them: the rows' page tables and slots gathered from the
    # request state, the sequence lengths (q_pos + 1) and the rotary cos/sin of the positions
    hq, hkv, d, ps, n, layers, b = 4, 2, 32, 16, 24, 4, 2
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    state_table = torch.randperm(n)[: 3 * 8].view(3, 8)
    consumed = torch.tensor([37, 5, 80])

    def step(qkv, rows, caches):
        pos = consumed[rows]
        table = state_table[rows]
        slots = table.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
        emb = torch.cat([(inv[None, :, None] @ pos[None, None, :].float()).transpose(1, 2)] * 2, -1)
        cos, sin = emb.cos(), emb.sin()
        lens = pos + 1
        out = qkv[:, : hq * d]
        for kc, vc in caches:
            o = ta.decode_attention_from_qkv(
                qkv + out.sum(), kc, vc, table, lens, d**-0.5, slots, hq, None, None,
                0.0, 0.0, cos[0], sin[0],
            )
            out = o.reshape(b, -1)
        return out

    rows = torch.tensor([2, 0])
    qkv = torch.randn(b, (hq + 2 * hkv) * d)
    base = [(torch.randn(n + 1, ps, hkv, d), torch.randn(n + 1, ps, hkv, d)) for _ in range(layers)]
    eager_caches = [(k.clone(), v.clone()) for k, v in base]
    want = step(qkv, rows, eager_caches)
    caches = [(k.clone(), v.clone()) for k, v in base]
    got, (code,) = run_and_get_code(torch.compile(step, fullgraph=True), qkv, rows, caches)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got - want).abs().max()
    # (the compiled sums round differently: the pages agree to fp32 rounding)
    assert all(torch.allclose(a[i], c[i], rtol=1e-5, atol=1e-6)
               for a, c in zip(eager_caches, caches) for i in (0, 1))

    def arguments(text):  # the top-level arguments of a call's text, from its "("
        args, depth, cur = [], 0, ""
        for ch in text:
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth < 0:
                    break
            if ch == "," and depth == 0:
                args.append(cur.strip())
                cur = ""
            else:
                cur += ch
        return args + [cur.strip()]

    # every layer's call reads the same stored page table, lengths, slots and cos/sin: none is
    # copied (recomputed from the request state) for a layer
    call = code[code.index("def call("):]
    op = "torch.ops.flare.paged_decode_attention_from_qkv.default("
    calls = [arguments(part) for part in call.split(op)[1:]]
    assert len(calls) == layers, len(calls)
    shared = [tuple(c[i] for i in (3, 4, 6, 12, 13)) for c in calls]
    assert len(set(shared)) == 1, shared
    print("ok")
    """
)


@pytest.mark.slow
def test_compiled_layers_share_the_steps_inputs_instead_of_copying_them_per_layer():
    """The decode attention ops take the step's shared inputs (gathered page tables, slots,
    q_pos + 1, rotary cos/sin) as the compiler stored them once: every layer of a compiled
    four-layer step reads the same buffers (no per-layer copy recomputing them), and the output
    and pages agree with eager execution's."""
    run_interpreted(SHARED_INPUTS_SCRIPT, timeout_s=600)


LAYOUTS_SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import triton_attention as ta

    torch.manual_seed(0)
    # the ops take their shared inputs as the compiler laid them out (a flexible layout): the
    # same call with column slices of wider tensors, cos/sin rows of different strides, a
    # size-one row dimension of stride 0 and a page table whose rows are every other row of a
    # bigger one gives bitwise the contiguous call's output and pages
    hq, hkv, d, ps, n = 4, 2, 32, 16, 40

    def strided(t):  # the same values, the last dimension's elements two apart
        wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    for lens in ([37], [37, 5, 80]):
        b = len(lens)
        pt = torch.randperm(n)[: b * 8].view(b, 8)
        seq = torch.tensor(lens)
        pos = seq - 1
        slots = pt.gather(1, (pos // ps)[:, None]).squeeze(1) * ps + pos % ps
        qkv = torch.randn(b, (hq + 2 * hkv) * d)
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        emb = torch.cat([pos[:, None].float() * inv[None, :]] * 2, dim=-1)
        cos, sin = emb.cos(), emb.sin()
        base = torch.randn(n + 1, ps, hkv, d), torch.randn(n + 1, ps, hkv, d)
        outs = []
        bigger = torch.full((2 * b, 8), -1)
        bigger[::2] = pt
        for variant in ("contiguous", "strided"):
            kc, vc = base[0].clone(), base[1].clone()
            if variant == "contiguous":
                args = (pt, seq, slots, cos, sin)
            else:
                c = cos[0].expand(1, d) if b == 1 else strided(cos)  # b = 1: a stride-0 row
                s = torch.cat([sin, sin], dim=1)[:, :d]  # rows 2 D apart, not D
                args = (bigger[::2], strided(seq), strided(slots), c, s)
            table, lengths, sl, c, s = args
            out = ta.decode_attention_from_qkv(
                qkv, kc, vc, table, lengths, d**-0.5, sl, hq, None, None, 0.0, 0.0, c, s
            )
            outs.append((out, kc, vc))
        (o1, k1, v1), (o2, k2, v2) = outs
        assert torch.equal(o1, o2) and torch.equal(k1, k2) and torch.equal(v1, v2), lens
    print("ok")
    """
)


def test_decode_attention_takes_its_shared_inputs_in_any_layout():
    """What a flexible layout may hand the decode op (strided lengths, slots and page-table
    rows, cos/sin with different row strides or a stride-0 single row) gives bitwise the
    contiguous call's output and pages."""
    run_interpreted(LAYOUTS_SCRIPT, timeout_s=600)


def test_the_decode_attention_is_given_the_o_projections_weight_to_warm(monkeypatch):
    """attend_from_qkv of a decode step hands the op the layer's o projection weight (the
    product that runs next, which `launch.set_attention_prefetch` may warm in L2); a prefill
    chunk and a module without an o projection pass none."""
    import torch

    from prep.components import triton_attention as ta
    from prep.components.paged_attention import AttentionMeta, PagedKVCache

    seen: list = []
    monkeypatch.setattr(ta, "decode_attention_from_qkv", lambda *a: seen.append(a[-1]) or a[0])
    monkeypatch.setattr(ta, "prefill_attention_from_qkv", lambda *a: seen.append(len(a)) or a[0])
    k = torch.zeros(3, 16, 2, 8)
    cache = PagedKVCache([k], [k.clone()], 16)
    one = torch.zeros(1, dtype=torch.long)
    meta = AttentionMeta(
        "decode", one, one, one, torch.zeros(1, 2, dtype=torch.long), cache, {0: 0}
    )
    module = torch.nn.Module()
    module.o_proj = torch.nn.Linear(16, 32, bias=False)
    qkv, cs = torch.zeros(1, 64), torch.zeros(1, 8)
    backend = ta.TritonAttentionBackend()
    backend.attend_from_qkv(module, qkv, 4, None, cs, cs, meta, 1.0)
    assert seen[-1] is module.o_proj.weight
    backend.attend_from_qkv(torch.nn.Module(), qkv, 4, None, cs, cs, meta, 1.0)
    assert seen[-1] is None
    meta.mode = "prefill"
    backend.attend_from_qkv(module, qkv, 4, None, cs, cs, meta, 1.0)
    assert seen[-1] == 14  # the prefill op's arguments, no weight among them


OWN_KEYS_SCRIPT = QKV_PREAMBLE + textwrap.dedent(
    """
    # a chunk that starts its prompt (n tokens, then padding rows at position 0 whose slots
    # go to the trash page, as the runner stages them) through the own-keys path against the
    # paged one: the same pages bit for bit (the same KV write), the chunk's rows to fp32
    # rounding; the heads own_keys_heads hands the attention (its one launch) against the
    # canonical norm and rotary embedding, and its pages bit for bit the paged op's. GQA 4, 3
    # (padded to 4 in the kernel) and 1, with and without q/k norms
    for hq, hkv, d, ps, norm in [(8, 2, 32, 16, True), (6, 2, 32, 16, True), (4, 4, 64, 16, False)]:
        for n, cap in [(37, 40), (16, 16), (1, 8)]:
            npages = -(-cap // ps) + 1
            pt = torch.full((1, npages + 1), -1)
            pt[0, :npages] = torch.randperm(npages + 4)[:npages]
            pos = torch.cat([torch.arange(n), torch.zeros(cap - n, dtype=torch.long)])
            slots = pt[0, pos // ps] * ps + pos % ps
            slots[n:] = -1
            qkv = torch.randn(cap, (hq + 2 * hkv) * d)
            qn, kn = torch.rand(d) + 0.5, torch.rand(d) + 0.5
            inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
            emb = torch.cat([pos[:, None].float() * inv[None, :]] * 2, dim=-1)
            cos, sin = emb.cos(), emb.sin()
            base_k = torch.randn(npages + 5, ps, hkv, d)
            base_v = torch.randn(npages + 5, ps, hkv, d)
            k1, v1, k2, v2 = base_k.clone(), base_v.clone(), base_k.clone(), base_v.clone()
            norms = (qn, kn) if norm else (None, None)
            want = ta.prefill_attention_from_qkv(
                qkv, k1, v1, pt, pos, d**-0.5, slots, hq, *norms, 1e-6, 1e-6, cos, sin
            )
            got = ta.prefill_attention_own_keys_from_qkv(
                qkv, k2, v2, d**-0.5, slots, hq, *norms, 1e-6, 1e-6, cos, sin
            )
            what = (hq, hkv, norm, n, cap)
            assert torch.equal(k1, k2) and torch.equal(v1, v2), what
            assert got.shape == want.shape and got.is_contiguous(), what
            assert rel(got[:n], want[:n]) < 1e-5, (what, rel(got[:n], want[:n]))
            heads = qkv.view(cap, -1, d)
            q, k = heads[:, :hq], heads[:, hq : hq + hkv]
            if norm:
                q, k = rms(q, qn), rms(k, kn)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k3, v3 = base_k.clone(), base_v.clone()
            heads3 = ta.own_keys_heads(qkv, k3, v3, slots, hq, *norms, 1e-6, 1e-6, cos, sin)
            assert torch.equal(k3, k1) and torch.equal(v3, v1), what
            for got_h, want_h in zip(heads3, (q, k, heads[:, hq + hkv :])):
                assert got_h.is_contiguous() and got_h.shape == want_h.shape, what
                assert rel(got_h, want_h) < 1e-6, (what, rel(got_h, want_h))
    print("ok")
    """
)


@pytest.mark.slow
def test_a_chunk_that_starts_its_prompt_attends_over_its_own_keys_as_the_paged_kernel_does():
    """prefill_attention_own_keys_from_qkv (prefill{C}_fresh's attention: the KV write, the
    query and key heads rotated into buffers of their own, a causal attention over the chunk's
    keys) against prefill_attention_from_qkv, interpreted on CPU (fp32)."""
    run_interpreted(OWN_KEYS_SCRIPT, timeout_s=600)
