"""The decode skinny GEMM kernel, run by Triton's interpreter on CPU (fp32).

The kernel is one dot product per output element over K in a fixed order, so against a float64
reference the error is fp32 rounding over K terms (bound 1e-6 relative L2 for these sizes), and
a row's result is bitwise independent of the rows beside it.
"""

from __future__ import annotations

import textwrap

from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components.skinny_gemm import TileConfig, skinny_matmul_into, tile_config
    torch.manual_seed(0)
    cfg = TileConfig(16, 64, 4, 2)
    for m, n, k in [(1, 40, 300), (3, 64, 256), (16, 33, 17), (8, 100, 64)]:
        x = torch.randn(m, k); w = torch.randn(n, k); y = torch.empty(m, n)
        skinny_matmul_into(y, x, w, cfg)
        ref = x.double() @ w.double().T
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-6, (m, n, k, err)
    # strided rows (a view into a wider buffer) and the shape-only configuration
    big = torch.randn(4, 96)
    x = big[:, :64]
    w = torch.randn(48, 64); y = torch.empty(4, 48)
    skinny_matmul_into(y, x, w, cfg)
    assert ((y.double() - x.double() @ w.double().T).norm() / y.norm()).item() < 1e-6
    assert tile_config(2048, 2048) == tile_config(2048, 2048)
    # every shape class's configuration (deep K-tiles, wide N-tiles) on ragged small shapes
    for n_class in (2048, 4096, 8192, 151936):
        c = tile_config(n_class, 4096)
        x = torch.randn(3, 700); w = torch.randn(70, 700); y = torch.empty(3, 70)
        skinny_matmul_into(y, x, w, c)
        ref = x.double() @ w.double().T
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-6, c
    # batch invariance: row 5 alone == row 5 among 16
    x = torch.randn(16, 256); w = torch.randn(48, 256)
    ya = torch.empty(16, 48); skinny_matmul_into(ya, x, w, cfg)
    for r in (0, 5, 15):
        y1 = torch.empty(1, 48); skinny_matmul_into(y1, x[r : r + 1].clone(), w, cfg)
        assert torch.equal(ya[r : r + 1], y1), r
    try:
        skinny_matmul_into(torch.empty(17, 4), torch.randn(17, 8), torch.randn(4, 8), cfg)
    except ValueError as exc:
        assert "at most 16 rows" in str(exc)
    else:
        raise AssertionError("17 rows accepted")
    print("ok")
    """
)


def test_skinny_gemm_interpreted_exact_and_batch_invariant():
    run_interpreted(SCRIPT)
