"""Flare's two-launch top-k (prep/components/triton_topk.py), run by Triton's interpreter on CPU.

Keys pack a value's order and its index into one int64, so the result must be exactly the
library's values, with the lowest indices among equal values, and a row's result must not
depend on the rows beside it. Small chunks here make stage 2 merge several chunks' candidates
at interpreter speed (the served chunk, 4,096 values, is what the GPU test runs).
"""

from __future__ import annotations

import textwrap

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

    # shapes it does not serve: None from plan, ValueError from the launch
    assert plan(151936, 64) == (38, 64, 4096) and plan(151936, 20) == (38, 32, 2048)
    assert plan(1000, MAX_K + 1) is None and plan(16, 16) == (1, 16, 16) and plan(10, 16) is None
    assert plan(2**20, 64) is None  # 256 chunks x 64 candidates: past one program's keys
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


def test_triton_topk_interpreted_matches_the_library():
    run_interpreted(SCRIPT)
