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
    # batch invariance: a row's result is bitwise the same whatever the other rows hold and
    # however many there are. It keeps its place in the tile here: the interpreter's dot is
    # numpy's, whose BLAS may round a row by its position (OpenBLAS's AVX2 kernel: rows 6-11
    # of 16); independence of the position is the GPU's MMA property (tests/gpu).
    x = torch.randn(16, 256); w = torch.randn(48, 256)
    ya = torch.empty(16, 48); skinny_matmul_into(ya, x, w, cfg)
    for r in (0, 5, 7, 15):
        xb = torch.randn(r + 1, 256); xb[r] = x[r]
        yb = torch.empty(r + 1, 48); skinny_matmul_into(yb, xb, w, cfg)
        assert torch.equal(ya[r], yb[r]), r
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
    # batch invariance holds with the prologues: a row's sum of squares is its own (the row
    # keeps its place in the tile: see the plain kernel's test)
    x = torch.randn(16, 256); w = torch.randn(48, 256); nw = torch.rand(256); r = torch.randn(16, 48)
    ya = torch.empty(16, 48)
    skinny_matmul_into(ya, x, w, cfg, norm_weight=nw, eps=1e-6, residual=r)
    for i in (0, 7, 15):
        xb = torch.randn(i + 1, 256) * 5; xb[i] = x[i]
        rb = torch.randn(i + 1, 48); rb[i] = r[i]
        yb = torch.empty(i + 1, 48)
        skinny_matmul_into(yb, xb, w, cfg, norm_weight=nw, eps=1e-6, residual=rb)
        assert torch.equal(ya[i], yb[i]), i
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


FOLDED = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from prep.components.skinny_gemm import (
        TileConfig, fold_norm, folded_reference, fused_reference, interleave_pairs,
        skinny_matmul_into,
    )
    torch.manual_seed(2)
    cfg = TileConfig(16, 64, 4, 2)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def rmsnorm(x, nw, eps):
        h = x.double()
        return nw.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))

    for m, f, k in [(1, 20, 300), (3, 33, 256), (16, 8, 17)]:
        x = torch.randn(m, k) * 3; nw = torch.rand(k) + 0.5
        # q|k|v: the norm's weight folded into the projection, 1/rms after the plain K loop
        w = torch.randn(2 * f, k)
        y = torch.empty(m, 2 * f)
        skinny_matmul_into(y, x, fold_norm(w, nw), cfg, eps=1e-6, folded_norm=True)
        want = rmsnorm(x, nw, 1e-6) @ w.double().T
        assert rel(y, want) < 1e-5, (m, f, k, "folded", rel(y, want))
        assert rel(y, fused_reference(x.double(), w.double(), nw.double(), 1e-6, False, None)) < 1e-5
        # gate|up: folded norm, interleaved rows, SiLU(gate) * up in the epilogue
        gate, up = torch.randn(f, k), torch.randn(f, k)
        wp = fold_norm(interleave_pairs(gate, up), nw)
        y = torch.empty(m, f)
        skinny_matmul_into(y, x, wp, cfg, eps=1e-6, folded_norm=True, silu_pairs=True)
        h = rmsnorm(x, nw, 1e-6)
        want = F.silu(h @ gate.double().T) * (h @ up.double().T)
        assert rel(y, want) < 1e-5, (m, f, k, "pairs", rel(y, want))
        assert rel(y, folded_reference(x.double(), wp.double(), 1e-6, True, None)) < 1e-5
        # the pairs epilogue alone (x as given), ragged F against the 8-pair program
        y = torch.empty(m, f)
        skinny_matmul_into(y, x, interleave_pairs(gate, up), cfg, silu_pairs=True)
        want = F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
        assert rel(y, want) < 1e-5, (m, f, k, "pairs alone", rel(y, want))
    # batch invariance with the pre-pass: a row's sum of squares is its own
    x = torch.randn(16, 256); wp = interleave_pairs(torch.randn(24, 256), torch.randn(24, 256))
    ya = torch.empty(16, 24)
    skinny_matmul_into(ya, x, wp, cfg, eps=1e-6, folded_norm=True, silu_pairs=True)
    for i in (0, 9, 15):  # the row keeps its place in the tile: see the plain kernel's test
        xb = torch.randn(i + 1, 256) * 5; xb[i] = x[i]
        yb = torch.empty(i + 1, 24)
        skinny_matmul_into(yb, xb, wp, cfg, eps=1e-6, folded_norm=True, silu_pairs=True)
        assert torch.equal(ya[i], yb[i]), i
    for bad in (dict(silu_pairs=True, residual=torch.randn(2, 8)),  # pairs take no residual
                dict(folded_norm=True, norm_weight=torch.ones(8))):  # one prologue
        refused = False
        try:
            skinny_matmul_into(torch.empty(2, 4), torch.randn(2, 8), torch.randn(8, 8), cfg, **bad)
        except ValueError:
            refused = True
        assert refused, bad
    print("ok")
    """
)


def test_folded_norm_and_silu_pairs_interpreted():
    """The folded decode variants: RMSNorm's weight folded into the projection (1/rms from a
    pass over x before the plain K loop) and SiLU(gate) * up in gate|up's epilogue from
    interleaved rows, against the canonical operations in float64."""
    run_interpreted(FOLDED)


SPLIT_K = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from prep.components import launch
    from prep.components.skinny_gemm import (
        TileConfig, fold_norm, interleave_pairs, set_split_k, skinny_matmul_into, split_plan,
        tile_config,
    )
    torch.manual_seed(3)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    def counters_zero():
        c = launch._COUNTERS.get(("skinny_split_k", torch.device("cpu")))
        return c is not None and not bool(c.any())

    assert split_plan(2048, TileConfig(16, 256, 4, 4, 4)) == (4, 512)
    assert split_plan(700, TileConfig(16, 64, 4, 2, 4)) == (4, 192)  # 11 K-tiles: 3, 3, 3, 2
    assert split_plan(100, TileConfig(16, 64, 4, 2, 8)) == (2, 64)  # no program without columns
    assert split_plan(100, TileConfig(16, 64, 4, 2, 1)) == (1, 100)
    for splits in (2, 3, 4, 16):
        cfg = TileConfig(16, 64, 4, 2, splits)
        for m, n, k in [(1, 40, 300), (3, 64, 256), (16, 33, 17), (8, 100, 700)]:
            x = torch.randn(m, k); w = torch.randn(n, k); y = torch.empty(m, n)
            skinny_matmul_into(y, x, w, cfg)
            ref = x.double() @ w.double().T
            assert rel(y, ref) < 1e-6, (splits, m, n, k, rel(y, ref))
            assert counters_zero(), "the last program left its count"
    cfg = TileConfig(16, 64, 4, 2, 4)
    # the folded layer's launches: norm folded in (the sum of squares over the whole row in
    # every split), SiLU pairs and the residual in the last program's epilogue
    m, f, k = 3, 24, 320
    x = torch.randn(m, k) * 3; nw = torch.rand(k) + 0.5
    h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double()
    gate, up = torch.randn(f, k), torch.randn(f, k)
    y = torch.empty(m, f)
    skinny_matmul_into(y, x, fold_norm(interleave_pairs(gate, up), nw), cfg, eps=1e-6,
                       folded_norm=True, silu_pairs=True)
    want = F.silu(h @ gate.double().T) * (h @ up.double().T)
    assert rel(y, want) < 1e-5, rel(y, want)
    w = torch.randn(40, k); r = torch.randn(m, 40); y = torch.empty(m, 40)
    skinny_matmul_into(y, x, w, cfg, residual=r)
    assert rel(y, x.double() @ w.double().T + r.double()) < 1e-6
    xs = torch.randn(m, 2 * k)  # SiLU * up prologue: each split reads its own K range of both
    y = torch.empty(m, 40)
    skinny_matmul_into(y, xs, w, cfg, silu_mul=True)
    want = (F.silu(xs[:, :k].double()) * xs[:, k:].double()) @ w.double().T
    assert rel(y, want) < 1e-5, rel(y, want)
    assert counters_zero()
    # batch invariance: the partials are summed in split order whatever M is
    x = torch.randn(16, 256); w = torch.randn(48, 256)
    ya = torch.empty(16, 48); skinny_matmul_into(ya, x, w, cfg)
    for r_ in (0, 5, 15):  # the row keeps its place in the tile: see the plain kernel's test
        xb = torch.randn(r_ + 1, 256); xb[r_] = x[r_]
        yb = torch.empty(r_ + 1, 48); skinny_matmul_into(yb, xb, w, cfg)
        assert torch.equal(ya[r_], yb[r_]), r_
    refused = False
    try:  # the in-loop RMSNorm's sum of squares would be split with K
        skinny_matmul_into(torch.empty(2, 8), torch.randn(2, 256), torch.randn(8, 256), cfg,
                           norm_weight=torch.ones(256), eps=1e-6)
    except ValueError as exc:
        refused = "folded_norm" in str(exc)
    assert refused
    # decode_split_k on: shape-chosen configurations split, except under the in-loop norm
    set_split_k(True, sms=8)
    try:
        x = torch.randn(2, 1024); w = torch.randn(64, 1024); nw = torch.rand(1024) + 0.5
        assert tile_config(64, 1024).split_k == 2
        y = torch.empty(2, 64)
        skinny_matmul_into(y, x, w)
        assert rel(y, x.double() @ w.double().T) < 1e-6
        skinny_matmul_into(y, x, w, norm_weight=nw, eps=1e-6)  # runs unsplit instead
        h = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
        assert rel(y, (h * nw.double()) @ w.double().T) < 1e-5
    finally:
        set_split_k(False)
    print("ok")
    """
)


def test_split_k_sums_partials_in_the_last_program_interpreted():
    """K split over several programs per N-tile, the last to finish summing the partials in
    split order and running the epilogue (plain, folded norm + SiLU pairs, residual, SiLU * up
    prologue): equal to float64 references, batch invariant, every counter back to zero, and
    the in-loop norm prologue refused."""
    run_interpreted(SPLIT_K)
