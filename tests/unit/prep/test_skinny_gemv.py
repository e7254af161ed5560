"""The register GEMV for decode products, run by Triton's interpreter on CPU (fp32).

Each row is one pass over the weight held in registers: fp32 products summed over a chunk,
chunk after chunk, split after split in a fixed order, so against a float64 reference the error
is fp32 rounding over K terms (1e-6 relative L2 for these sizes), and a row's result is bitwise
independent of how many rows run beside it and of what they hold.
"""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import launch
    from prep.components.skinny_gemv import GemvConfig, gemv_into, gemv_plan
    torch.manual_seed(0)
    assert gemv_plan(6144, GemvConfig(16, 2048, 8, 3)) == (3, 1)
    assert gemv_plan(6144, GemvConfig(16, 1024, 8, 2)) == (2, 3)
    assert gemv_plan(2048, GemvConfig(16, 1024, 8, 4)) == (2, 1)  # no program without columns
    assert gemv_plan(700, GemvConfig(8, 256, 4, 1)) == (1, 3)
    cfgs = [GemvConfig(8, 64, 4), GemvConfig(16, 128, 4, 2), GemvConfig(4, 32, 2, 3),
            GemvConfig(16, 512, 8), GemvConfig(16, 64, 4, 2, "dot"),
            GemvConfig(32, 128, 4, 1, "dot"),
            GemvConfig(8, 64, 4, 1, "xl1"), GemvConfig(4, 32, 2, 3, "xl1"),
            GemvConfig(8, 512, 4, 1, "seg"), GemvConfig(4, 32, 2, 3, "seg")]
    for cfg in cfgs:
        for m, n, k in [(1, 40, 300), (3, 64, 256), (16, 33, 17), (8, 100, 700)]:
            x = torch.randn(m, k); w = torch.randn(n, k); y = torch.empty(m, n)
            gemv_into(y, x, w, cfg)
            ref = x.double() @ w.double().T
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-6, (cfg, m, n, k, err)
    # counters at rest after the split launches (the last program of each tile resets its own)
    assert int(launch.zeroed_counters("skinny_split_k", torch.device("cpu"), 1).abs().sum()) == 0
    # strided rows (a view into a wider buffer)
    big = torch.randn(4, 96); x = big[:, :64]
    w = torch.randn(48, 64); y = torch.empty(4, 48)
    gemv_into(y, x, w, cfgs[1])
    assert ((y.double() - x.double() @ w.double().T).norm() / y.norm()).item() < 1e-6
    # batch invariance: row r's result is bitwise the same alone, among others, at any place
    x = torch.randn(16, 300); w = torch.randn(40, 300)
    for cfg in cfgs[:3] + cfgs[4:5] + cfgs[6:]:
        ya = torch.empty(16, 40); gemv_into(ya, x, w, cfg)
        for r in (0, 5, 15):
            xb = torch.randn(r + 1, 300); xb[r] = x[r]
            yb = torch.empty(r + 1, 40); gemv_into(yb, xb, w, cfg)
            assert torch.equal(ya[r], yb[r]), (cfg, r)
            if cfg.form != "dot":  # at another place too (the interpreter's dot is numpy's BLAS,
                # which may round a row by its position; the MMA does not: tests/gpu)
                y1 = torch.empty(1, 40); gemv_into(y1, x[r : r + 1], w, cfg)
                assert torch.equal(ya[r], y1[0]), (cfg, r)
    # xl1: the same arithmetic as a pass per row, so the same bits
    for m in (1, 5, 16):
        xa, wa = torch.randn(m, 300), torch.randn(40, 300)
        ya, yb = torch.empty(m, 40), torch.empty(m, 40)
        gemv_into(ya, xa, wa, GemvConfig(8, 64, 4, 2))
        gemv_into(yb, xa, wa, GemvConfig(8, 64, 4, 2, "xl1"))
        assert torch.equal(ya, yb), m
    for bad in [(torch.empty(17, 4), torch.randn(17, 8), torch.randn(4, 8)),
                (torch.empty(2, 4), torch.randn(2, 9), torch.randn(4, 8))]:
        try:
            gemv_into(*bad, cfgs[0])
        except ValueError as exc:
            assert "at most 16 rows" in str(exc) or "weight" in str(exc), exc
        else:
            raise AssertionError("accepted")
    x1, w8 = torch.randn(1, 64), torch.randn(8, 64)
    try:
        gemv_into(torch.empty(1, 8), x1, w8, GemvConfig(8, 64, 4, form="mma"))
    except ValueError as exc:
        assert "unknown GEMV form" in str(exc)
    else:
        raise AssertionError("an unknown form accepted")
    try:
        gemv_into(torch.empty(1, 8), x1, w8, GemvConfig(8, 48, 4))
    except ValueError as exc:
        assert "powers of two" in str(exc)
    else:
        raise AssertionError("a 48-column chunk accepted")
    try:  # tl.dot's smallest tile
        gemv_into(torch.empty(1, 8), x1, w8, GemvConfig(8, 64, 4, form="dot"))
    except ValueError as exc:
        assert "16 weight rows" in str(exc)
    else:
        raise AssertionError("an 8-row dot accepted")
    # the folded layers' epilogues (the tile kernel's): 1/rms of each row, SiLU(gate) * up over
    # interleaved rows, the residual add; against float64, batch invariant
    from prep.components.skinny_gemm import folded_reference
    for cfg in (GemvConfig(8, 64, 4), GemvConfig(16, 128, 4, 2), GemvConfig(4, 32, 2, 3, "seg")):
        for norm, pairs, res in ((True, False, False), (True, True, False), (False, False, True),
                                 (False, True, False), (True, False, True)):
            for m, n, k in [(5, 40, 300), (16, 24, 700)]:
                x, w = torch.randn(m, k), torch.randn(n, k)
                r = torch.randn(m, n) if res else None
                y = torch.empty(m, n // 2 if pairs else n)
                kw = dict(eps=1e-6, folded_norm=norm, silu_pairs=pairs, residual=r)
                gemv_into(y, x, w, cfg, **kw)
                ref = folded_reference(x.double(), w.double(), 1e-6 if norm else None, pairs,
                                       None if r is None else r.double())
                err = ((y.double() - ref).norm() / ref.norm()).item()
                assert err < 1e-5, (cfg, norm, pairs, res, m, n, k, err)
                if m == 16:  # a row alone: the same bits (its own sum of squares, its passes)
                    y1 = torch.empty(1, y.shape[1])
                    gemv_into(y1, x[7:8], w, cfg, eps=1e-6, folded_norm=norm, silu_pairs=pairs,
                              residual=None if r is None else r[7:8])
                    assert torch.equal(y1[0], y[7]), (cfg, norm, pairs, res)
    for bad, msg in (((torch.empty(2, 40), torch.randn(2, 64), torch.randn(40, 64)), "weight"),
                     ((torch.empty(2, 20), torch.randn(2, 64), torch.randn(41, 64)), "even")):
        try:
            gemv_into(*bad, GemvConfig(8, 64, 4), silu_pairs=True)
        except ValueError as exc:
            assert msg in str(exc), exc
        else:
            raise AssertionError("accepted")
    # decode_gemm "gemv": skinny_linear routes the narrow products (by shape alone) to the GEMV
    from prep.components import skinny_gemm, skinny_gemv
    from prep.components.skinny_gemm import skinny_linear, skinny_matmul_into
    from prep.components.skinny_gemv import gemv_config
    assert gemv_config(8192, 4096) == GemvConfig(8, 2048, 8, 1, "cores")
    assert gemv_config(2048, 700) == GemvConfig(8, 1024, 8, 1, "cores")
    assert gemv_config(8193, 4096) is None and gemv_config(4096, 12288) is None
    x = torch.randn(3, 300); w = torch.randn(40, 300)
    skinny_gemm.set_gemv(True)
    try:
        want = torch.empty(3, 40); gemv_into(want, x, w, gemv_config(40, 300))
        assert torch.equal(skinny_linear(x, w), want)
        skinny_gemv.GEMV_MAX_N = 32  # a "wide" product: the tile kernel's result
        tiles = torch.empty(3, 40); skinny_matmul_into(tiles, x, w)
        assert torch.equal(skinny_linear(x, w), tiles)
    finally:
        skinny_gemm.set_gemv(False)
    print("ok")
    """
)


@pytest.mark.slow
def test_gemv_matches_float64_and_is_batch_invariant_interpreted():
    run_interpreted(SCRIPT)
