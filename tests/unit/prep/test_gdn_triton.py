"""The CUDA GDN decode kernel, run by Triton's interpreter on CPU (fp32), against the reference.

The kernel applies the same update rule as `ReferenceGDN` with different reduction orders (one
fused sum over Dk per element), so outputs and states agree to fp32 rounding over Dk terms:
bound 1e-5 relative L2 (measured ~1e-7). Rows that are not named, and NULL_ROW, must stay
bit-identical: padding stores nothing.
"""

from __future__ import annotations

import textwrap

from triton_interpreter import run_interpreted

SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import gated_deltanet as gdn
    from prep.components.gdn_triton import TritonGDN
    from prep.components.state_pool import StatePool

    torch.manual_seed(0)
    for hk, hv, dk, dv in [(2, 4, 16, 8), (1, 2, 32, 64), (2, 2, 16, 32)]:
        shape = gdn.GDNShape(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                             conv_kernel=4)
        specs = gdn.state_tensors(0, shape)
        pool = StatePool.allocate(specs, 5, 2, 8, torch.float32, "cpu")
        for t in pool.tensors:
            t[1:].normal_()
        rows = torch.tensor([3, 0, 1, 0])  # two padding rows
        b = rows.shape[0]
        mixed = torch.randn(b, shape.conv_dim)
        weight = torch.randn(shape.conv_dim, 4) * 0.5
        g = -torch.rand(b, hv) * 0.3
        beta = torch.rand(b, hv)
        ref_pool = StatePool.allocate(specs, 5, 2, 8, torch.float32, "cpu")
        for src, dst in zip(pool.tensors, ref_pool.tensors):
            dst.copy_(src)
        before = [t.clone() for t in pool.tensors]
        meta = gdn.RecurrentMeta("decode", rows, torch.tensor([b]), pool)
        ref_meta = gdn.RecurrentMeta("decode", rows, torch.tensor([b]), ref_pool)
        o = TritonGDN().mix(meta, pool.layer_tensors(0), shape, mixed, weight, g, beta)
        o_ref = gdn.REFERENCE.mix(ref_meta, ref_pool.layer_tensors(0), shape, mixed, weight, g, beta)
        live = rows != 0
        err = ((o[live] - o_ref[live]).norm() / o_ref[live].norm()).item()
        assert err < 1e-5, ("output", hk, hv, dk, dv, err)
        for t, r, t0 in zip(pool.tensors, ref_pool.tensors, before):
            e = ((t - r).norm() / r.norm()).item()
            assert e < 1e-5, ("state", e)
            for untouched in (0, 2, 4, 5, 6, 7):  # null row, other live rows, snapshot rows
                assert torch.equal(t[untouched], t0[untouched]), untouched
        # padding rows read the null state: their output is that of a zero state
        assert torch.isfinite(o).all()
    print("ok")
    """
)


def test_gdn_decode_kernel_interpreted_matches_reference():
    run_interpreted(SCRIPT)


CONV_SCRIPT = textwrap.dedent(
    """
    import torch
    from prep.components import gated_deltanet as gdn
    from prep.components.gdn_triton import conv_prefill_fits, gdn_conv_prefill

    torch.manual_seed(0)

    def unfused(x, hist, weight, num_valid, shape):
        # the path gdn_conv_prefill replaces, in the compiled arithmetic: fp32 sums, the SiLU
        # output rounded to x's dtype, then the fp32 L2 norm of each q / k head
        f32 = lambda a: a.float()
        y, new_hist = gdn.ReferenceGDN._conv_prefill(
            f32(x), f32(hist.to(x.dtype)), f32(weight), num_valid)
        y = y.to(x.dtype)
        t, kd = x.shape[0], shape.key_dim
        q, k, v = torch.split(y, [kd, kd, shape.value_dim], dim=-1)
        norm = lambda a: gdn.l2norm(a.reshape(t, -1, shape.head_k_dim).float()).to(x.dtype)
        return norm(q).reshape(t, kd), norm(k).reshape(t, kd), v, new_hist.to(x.dtype)

    for hk, hv, dk, dv in [(2, 4, 16, 16), (1, 2, 32, 64), (2, 2, 16, 32)]:
        shape = gdn.GDNShape(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv,
                             conv_kernel=4)
        assert conv_prefill_fits(shape)
        c = shape.conv_dim
        for dtype in (torch.float32, torch.bfloat16):
            for t, n in [(37, 37), (37, 20), (16, 2), (5, 0), (40, 1)]:
                wide = torch.randn(t, c + 24).to(dtype)  # rows strided, as a fused projection's
                x = wide[:, 8 : 8 + c]
                hist = torch.randn(c, 3).to(dtype)
                weight = (torch.randn(c, 4) * 0.5).to(dtype)
                num_valid = torch.tensor([n])
                got = gdn_conv_prefill(x, hist, weight, num_valid, shape.key_dim, dk)
                want = unfused(x, hist, weight, num_valid, shape)
                for name, a, b in zip(("q", "k", "v", "hist"), got, want):
                    assert a.dtype == dtype and a.is_contiguous() and a.shape == b.shape, name
                    if name == "hist":  # inputs moved, never computed: exact
                        assert torch.equal(a, b), (name, dtype, t, n)
                        continue
                    err = ((a.float() - b.float()).norm() / b.float().norm()).item()
                    # fp32: reduction order only; bf16: one rounding step of the output
                    bound = 1e-6 if dtype == torch.float32 else 8e-3
                    assert err < bound, (name, dtype, t, n, err)
    # a kernel that cannot run (compile or launch failure) falls back, once and for good, to
    # the same contract in PyTorch ops
    from prep.components import gdn_triton

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("no kernel here")
            return launch

    kernel, gdn_triton._conv_prefill_kernel = gdn_triton._conv_prefill_kernel, Broken()
    try:
        x = torch.randn(21, c + 8).to(torch.bfloat16)[:, 4 : 4 + c]
        hist = torch.randn(c, 3).to(torch.bfloat16)
        weight = (torch.randn(c, 4) * 0.5).to(torch.bfloat16)
        got = gdn_conv_prefill(x, hist, weight, torch.tensor([17]), shape.key_dim, dk)
        assert gdn_triton._ConvKernel.failed
        want = unfused(x, hist, weight, torch.tensor([17]), shape)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(a.is_contiguous() for a in got)
    finally:
        gdn_triton._conv_prefill_kernel = kernel
        gdn_triton._ConvKernel.failed = False
    assert not conv_prefill_fits(gdn.GDNShape(2, 2, 24, 24, 4))  # not a power of two
    assert not conv_prefill_fits(gdn.GDNShape(2, 1, 32, 48, 4))  # v channels not whole blocks
    print("ok")
    """
)


def test_gdn_conv_prefill_interpreted_matches_the_unfused_path():
    """The one-launch convolution + SiLU + q/k norms equals the unfused compiled arithmetic on
    strided rows, partial chunks (padding rows), and histories longer than the valid tokens;
    the carried history is moved exactly; where the kernel cannot run, PyTorch ops compute the
    same."""
    run_interpreted(CONV_SCRIPT)
