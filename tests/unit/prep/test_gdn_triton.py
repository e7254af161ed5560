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
