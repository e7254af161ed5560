"""Flare's top-k (prep/components/triton_topk.py), run by Triton's interpreter on CPU.

Keys pack a value's order and its index into one int64, so the result must be exactly the
library's values, with the lowest indices among equal values, and a row's result must not
depend on the rows beside it. Small chunks here make stage 2 merge several chunks' candidates
at interpreter speed (the served levels, 1,024-value chunks in groups of 16, are what the GPU
test runs).
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components.triton_topk import MAX_K, plan, topk_into
    g = torch.Generator().manual_seed(0)

    def run(x, k, chunk):
        vals = torch.empty(x.shape[0], k); idx = torch.empty(x.shape[0], k, dtype=torch.int64)
        topk_into(vals, idx, x, k, chunk)
        return vals, idx

    for n, v, k, chunk in [(3, 1000, 20, 128), (2, 500, 1, 64), (2, 256, 64, 256),
                           (1, 70, 64, 64), (4, 700, 64, 128), (2, 300, 5, 32)]:
        x = torch.randn(n, v, generator=g) * 3
        x[0, : v // 3] = float("-inf")  # banned tokens
        if n > 1:
            x[1] = torch.randint(0, 7, (v,), generator=g).float()  # ties everywhere
        x[-1, 3] = -0.0
        vals, idx = run(x, k, chunk)
        ref, _ = torch.topk(x, k, dim=-1)
        assert torch.equal(vals, ref), (n, v, k, chunk)
        assert torch.equal(x.gather(1, idx), vals), (n, v, k, chunk)
        # among equal values, the lowest indices, in ascending order
        for r in range(n):
            for value in vals[r].unique().tolist():
                got = idx[r][vals[r] == value].tolist()
                want = (x[r] == value).nonzero().flatten().tolist()[: len(got)]
                assert got == want, (r, value, got, want)
        # a row's result is its own: alone, or beside other rows, bitwise the same
        for r in range(n):
            v1, i1 = run(x[r : r + 1].clone(), k, chunk)
            assert torch.equal(v1[0], vals[r]) and torch.equal(i1[0], idx[r]), r

    # NaN is the largest, as the library orders it; every -inf row still yields k indices
    x = torch.randn(2, 400, generator=g)
    x[0, 7] = float("nan")
    x[1] = float("-inf")
    vals, idx = run(x, 4, 64)
    assert idx[0, 0].item() == 7 and torch.isnan(vals[0, 0])
    assert torch.equal(vals[0, 1:], torch.topk(x[0].nan_to_num(-1e9), 3).values)
    assert idx[1].tolist() == [0, 1, 2, 3] and bool((vals[1] == float("-inf")).all())

    # a middle stage (GROUP chunks per program, a partial last group) gives the same keys
    for n, v, k, chunk, group in [(3, 1000, 20, 64, 4), (2, 700, 64, 64, 2), (1, 70, 64, 64, 2),
                                  (2, 2000, 5, 32, 8)]:
        x = torch.randn(n, v, generator=g) * 3
        x[-1] = torch.randint(0, 9, (v,), generator=g).float()  # ties everywhere
        flat_v, flat_i = run(x, k, chunk)
        vals = torch.empty(n, k); idx = torch.empty(n, k, dtype=torch.int64)
        topk_into(vals, idx, x, k, chunk, group=group)
        assert torch.equal(vals, flat_v) and torch.equal(idx, flat_i), (n, v, k, chunk, group)
        want = torch.arange(n) % 2 == 1
        topk_into(vals, idx, x, k, chunk, want=want, group=group)
        assert torch.equal(vals[want], flat_v[want]) and not vals[~want].any()
    assert plan(151936, 64, 1024, 16) == (149, 64, 1024)  # 10 groups x 64 keys
    assert plan(151936, 64, 1024, 0) is None  # 149 x 64 keys: past one program's
    assert plan(151936, 64, 1024, 256) is None  # one group's 256 x 64 keys: the same

    # rows nobody asked for (`want` False): zeros, and the asked rows' results unchanged
    x = torch.randn(4, 900, generator=g) * 3
    full_v, full_i = run(x, 20, 128)
    want = torch.tensor([True, False, True, False])
    vals = torch.full((4, 20), 7.0); idx = torch.full((4, 20), 7, dtype=torch.int64)
    topk_into(vals, idx, x, 20, 128, want=want)
    assert torch.equal(vals[want], full_v[want]) and torch.equal(idx[want], full_i[want])
    assert not vals[~want].any() and not idx[~want].any()
    none = torch.zeros(4, dtype=torch.bool)
    topk_into(vals, idx, x, 20, 128, want=none)
    assert not vals.any() and not idx.any()
    for bad in (torch.ones(3, dtype=torch.bool), torch.ones(4, dtype=torch.int64)):
        try:
            topk_into(vals, idx, x, 20, 128, want=bad)
        except ValueError as exc:
            assert "want" in str(exc), exc
        else:
            raise AssertionError(bad)

    # shapes it does not serve: None from plan, ValueError from the launch
    # the defaults (1,024-value chunks, 16 per group): 10 groups' candidates for the merge
    assert plan(151936, 64) == (149, 64, 1024) and plan(151936, 20) == (149, 32, 512)
    assert plan(151936, 64, 4096, 0) == (38, 64, 4096)  # the two launches
    assert plan(1000, MAX_K + 1) is None and plan(16, 16) == (1, 16, 16) and plan(10, 16) is None
    assert plan(2**20, 64, 4096, 0) is None  # 256 chunks x 64 candidates: past one program's
    assert plan(2**23, 64) is None  # 512 groups x 64: the same
    for bad, k in ((torch.randn(2, 300, dtype=torch.float64), 4), (torch.randn(2, 300), 65)):
        try:
            run(bad.float() if k > MAX_K else bad, k, 64)
        except (ValueError, RuntimeError) as exc:
            assert "top-k" in str(exc) or "k <=" in str(exc), exc
        else:
            raise AssertionError((bad.dtype, k))
    print("ok")
    """
)


@pytest.mark.slow
def test_triton_topk_interpreted_matches_the_library():
    run_interpreted(SCRIPT)


COMPILED_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # compile this code, not a cached one
    import torch
    from torch._inductor.utils import run_and_get_code
    from prep.components.triton_topk import topk

    # the sampling's shape: one penalised row read by the top-k and by the full path's sort
    def two_paths(logits, penalty):
        shaped = torch.where(logits > 0, logits / penalty, logits * penalty)
        vals, idx = topk(shaped, 8)
        return vals, idx, torch.sort(shaped, dim=-1, descending=True, stable=True)[0]

    g = torch.Generator().manual_seed(0)
    logits, penalty = torch.randn(2, 3000, generator=g), torch.tensor(1.3)
    want = two_paths(logits, penalty)
    got, (code,) = run_and_get_code(torch.compile(two_paths, fullgraph=True), logits, penalty)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the penalised row is stored once: the top-k and the sort read the same buffer (without
    # the op's flexible layout the compiler writes a copy of the row for the top-k)
    call = code[code.index("def call("):]
    topk_arg = call.split("torch.ops.flare.topk.default(")[1].split(",")[0]
    sort_arg = call.split("torch.ops.aten.sort.stable(")[1].split(",")[0]
    assert topk_arg == sort_arg, (topk_arg, sort_arg)
    print("ok")
    """
)


def test_compiled_top_k_reads_a_row_the_sort_also_reads_without_a_copy():
    """The top-k's input, shared with the full path's sort, is stored once in a compiled graph
    (the op's flexible layout) and both read it; the results equal eager execution's."""
    run_interpreted(COMPILED_SCRIPT)
