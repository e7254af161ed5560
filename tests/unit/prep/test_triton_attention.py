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

    for hq, hkv, d, ps in [(4, 4, 32, 16), (8, 4, 64, 16), (8, 2, 32, 64), (6, 2, 32, 16)]:
        n = 24
        kc = torch.randn(n + 1, ps, hkv, d)
        vc = torch.randn_like(kc)
        cache = PagedKVCache([kc], [vc], ps)
        perm = torch.randperm(n)
        # prefill: positions start mid-page; the table holds exactly the pages in use + unused
        # the last chunk is short after a long history: its key blocks split over programs
        for start, t in [(ps // 2 + 1, 3 * ps + 5), (0, 7), (2 * ps - 1, 40), (330, 9)]:
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
            # exactly-sized table (no spare entry): the tail key block runs past it
            out2 = prefill_attention(q, kc, vc, pt[:, :npages].contiguous(), pos, d**-0.5)
            assert rel(out2, ref) < 1e-5
        # decode: 3 rows of different lengths
        lens = [1, ps + 3, 5 * ps]
        pt = torch.full((3, 8), -1)
        used = 0
        for i, length in enumerate(lens):
            k = -(-length // ps)
            pt[i, :k] = perm[used : used + k]
            used += k
        pos = torch.tensor(lens) - 1
        q = torch.randn(3, hq, d)
        meta = AttentionMeta("decode", pos * 0 - 1, pos, torch.arange(3), pt, cache, {0: 0})
        ref = reference_attention(meta, kc, vc, q, d**-0.5, None)
        out = decode_attention(q, kc, vc, pt, pos + 1, d**-0.5)
        assert rel(out, ref) < 1e-5, ("decode", hq, hkv, d, ps, rel(out, ref))
    print("ok")
    """
)


def test_attention_kernels_interpreted_match_reference():
    run_interpreted(SCRIPT, timeout_s=600)
