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


FUSED = textwrap.dedent(
    """
    import torch
    from prep.components.skinny_gemm import TileConfig, fused_reference, skinny_matmul_into
    torch.manual_seed(1)
    cfg = TileConfig(16, 64, 4, 2)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    for m, n, k in [(1, 40, 300), (3, 64, 256), (16, 33, 17)]:
        w = torch.randn(n, k); nw = torch.rand(k) + 0.5; res = torch.randn(m, n)
        x = torch.randn(m, k) * 3
        # RMSNorm prologue (1/rms applied after the K loop), with and without the residual
        for r in (None, res):
            y = torch.empty(m, n)
            skinny_matmul_into(y, x, w, cfg, norm_weight=nw, eps=1e-6, residual=r)
            ref = fused_reference(x.double(), w.double(), nw.double(), 1e-6, False,
                                  None if r is None else r.double())
            assert rel(y, ref) < 1e-5, (m, n, k, "norm", r is None, rel(y, ref))
        # SiLU * up prologue over a [M, 2K] gate|up row, and the residual
        gu = torch.randn(m, 2 * k)
        y = torch.empty(m, n)
        skinny_matmul_into(y, gu, w, cfg, silu_mul=True, residual=res)
        ref = fused_reference(gu.double(), w.double(), None, 0.0, True, res.double())
        assert rel(y, ref) < 1e-5, (m, n, k, "silu", rel(y, ref))
    # batch invariance holds with the prologues: a row's sum of squares is its own
    x = torch.randn(16, 256); w = torch.randn(48, 256); nw = torch.rand(256); r = torch.randn(16, 48)
    ya = torch.empty(16, 48)
    skinny_matmul_into(ya, x, w, cfg, norm_weight=nw, eps=1e-6, residual=r)
    for i in (0, 7, 15):
        y1 = torch.empty(1, 48)
        skinny_matmul_into(y1, x[i : i + 1].clone(), w, cfg, norm_weight=nw, eps=1e-6,
                           residual=r[i : i + 1].clone())
        assert torch.equal(ya[i : i + 1], y1), i
    for bad in (dict(norm_weight=torch.ones(8), silu_mul=True), dict(silu_mul=False)):
        refused = False
        try:
            skinny_matmul_into(torch.empty(2, 4), torch.randn(2, 16), torch.randn(4, 8), cfg, **bad)
        except ValueError:
            refused = True
        assert refused, bad
    print("ok")
    """
)


def test_fused_prologues_and_residual_interpreted():
    """The decode layer's fused projections (flare::skinny_fused): RMSNorm before q|k|v and
    gate|up, SiLU * up before down, the residual add after o and down, against the canonical
    operations in float64."""
    run_interpreted(FUSED)
