"""Teacher-forced logits of the prepared path vs the canonical Transformers forward (fp32, CPU).

Relative L2 per position with the reference norm as denominator; fp32 everywhere, so the bound
is tight (1e-5): only summation order differs.
"""

from __future__ import annotations

import pytest
import torch
from runner_harness import Harness, reference_logits, rel_l2

TOL = 1e-5


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def setup(request, tiny):
    from transformers import AutoModelForCausalLM

    mt = request.param
    bundle = tiny.bundle(mt)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(mt), dtype=torch.float32, attn_implementation="eager"
    )
    return bundle, hf


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


@pytest.mark.parametrize("split", [15, 16, 17, 31, 32, 33, 128, 129])
def test_chunked_prefill_across_page_boundaries(setup, split):
    bundle, hf = setup
    h = Harness(bundle)
    prompt = _prompt(200, split)
    ref = reference_logits(hf, prompt)
    h.admit(1, prompt)
    h.prefill(1, 0, split, sample=False)
    assert rel_l2(h.logits(1), ref[split - 1]) < TOL
    # a short middle chunk that starts at the boundary (its last position reads the first
    # chunk's pages and its own), then the rest
    h.prefill(1, split, 17, sample=False)
    assert rel_l2(h.logits(1), ref[split + 16]) < TOL
    h.prefill(1, split + 17, len(prompt) - split - 17, sample=True)
    assert rel_l2(h.logits(1), ref[-1]) < TOL


@pytest.mark.parametrize("n", [1, 100, 127, 128, 129, 255, 256])
def test_every_prefill_capacity_and_decode(setup, n):
    bundle, hf = setup
    h = Harness(bundle)
    prompt = _prompt(n, n)
    h.admit(2, prompt)
    h.prefill(2, 0, min(n, 256), sample=n <= 256)
    ref = reference_logits(hf, prompt)
    assert rel_l2(h.logits(2), ref[-1]) < TOL
    forced = _prompt(6, n + 1)
    for tok in forced:  # teacher-forced decode steps
        h.decode([2], forced={2: tok})
        assert rel_l2(h.logits(2), reference_logits(hf, h.seq[2][:-1])[-1]) < TOL


def test_batched_decode_mixed_lengths_changing_rows_and_reuse(setup):
    bundle, hf = setup
    h = Harness(bundle)
    lens = {1: 5, 3: 16, 4: 33, 7: 70}
    for row, n in lens.items():
        h.admit(row, _prompt(n, row))
        h.prefill(row, 0, n, sample=True)
    orders = [[1, 3, 4, 7], [7, 1], [4], [3, 7, 1], [1, 4, 3]]  # batch sizes 1-4, shuffled rows
    for step, rows in enumerate(orders):
        forced = {r: (step * 31 + r * 7) % 500 + 3 for r in rows}
        h.decode(rows, forced=forced)
        for r in rows:
            ref = reference_logits(hf, h.seq[r][:-1])[-1]
            assert rel_l2(h.logits(r), ref) < TOL, (step, r)
    # slot reuse: row 3 gets a new request; its old pages and state must not leak
    h.release(3)
    fresh = _prompt(20, 99)
    h.admit(3, fresh)
    h.prefill(3, 0, 20, sample=True)
    assert rel_l2(h.logits(3), reference_logits(hf, fresh)[-1]) < TOL
    h.decode([3, 1], forced={3: 11, 1: 12})
    assert rel_l2(h.logits(3), reference_logits(hf, h.seq[3][:-1])[-1]) < TOL


def test_padding_rows_write_nothing(setup):
    bundle, _ = setup
    h = Harness(bundle)
    h.admit(1, _prompt(10, 1))
    h.prefill(1, 0, 10, sample=True)
    st = h.r.state
    before = {k: v.clone() for k, v in vars(st).items()}
    kv_before = [t.clone() for t in h.r.kv.k_pages]
    h.decode([1])  # capacity 1: no padding; then a batch of 3 on capacity 4 pads one row
    h.admit(2, _prompt(4, 2))
    h.prefill(2, 0, 4, sample=True)
    h.admit(5, _prompt(4, 5))
    h.prefill(5, 0, 4, sample=True)
    h.decode([1, 2, 5])
    for k, v in vars(st).items():  # the null row never changes
        assert (
            torch.equal(v[0], before[k][0])
            if v.dim() and v.shape[0] == st.pending.shape[0]
            else True
        ), k
    trash = h.r.kv.trash_page
    for t, b in zip(
        h.r.kv.k_pages, kv_before
    ):  # only pages owned by rows 1, 2, 5 (and trash) change
        owned = set(h.pages[1]) | set(h.pages[2]) | set(h.pages[5]) | {trash}
        changed = {i for i in range(t.shape[0]) if not torch.equal(t[i], b[i])}
        assert changed <= owned
