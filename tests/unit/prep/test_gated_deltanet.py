"""The Gated DeltaNet reference and the state pool, against Transformers' own torch fallback.

Inputs are random with the real models' structure (L2-normalised q/k inside the rule, decays
exp(g) in (0, 1), beta in (0, 1)); fp32. Measured: the chunked and recurrent rules are
bit-identical to Transformers' torch fallback (same operation order); a split at an arbitrary
point vs one pass (the association changes): relative error 1.9e-7 (final state) and 2.9e-7
(outputs). Bounds asserted: 1e-5 absolute vs Transformers (so a reordered kernel still
passes), 1e-5 relative for splits, i.e. ~50x the measured split error.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from prep.bundle import Manifest, StateTensor, read_manifest
from prep.components import gated_deltanet as gdn
from prep.components.state_pool import NULL_ROW, StatePool, scatter_rows

SHAPE = gdn.GDNShape(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, conv_kernel=4)


def _inputs(t: int, seed: int, b: int | None = None):
    g = torch.Generator().manual_seed(seed)
    lead = (t,) if b is None else (b,)
    h = SHAPE.num_v_heads
    q = torch.randn(*lead, h, SHAPE.head_k_dim, generator=g)
    k = torch.randn(*lead, h, SHAPE.head_k_dim, generator=g)
    v = torch.randn(*lead, h, SHAPE.head_v_dim, generator=g)
    decay = -torch.rand(*lead, h, generator=g) * 0.3  # log decay in (-0.3, 0]
    beta = torch.rand(*lead, h, generator=g)
    return q, k, v, decay, beta


def _hf_rules():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


@pytest.mark.parametrize("t", [1, 37, 64, 130])
def test_chunked_rule_matches_transformers(t):
    chunk_hf, _ = _hf_rules()
    q, k, v, decay, beta = _inputs(t, t)
    s0 = torch.randn(SHAPE.num_v_heads, SHAPE.head_k_dim, SHAPE.head_v_dim) * 0.5
    o, s = gdn.chunk_gated_delta_rule(q, k, v, decay, beta, s0)
    o_ref, s_ref = chunk_hf(
        q[None], k[None], v[None], decay[None], beta[None], initial_state=s0[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert (o - o_ref[0]).abs().max() < 1e-5
    assert (s - s_ref[0]).abs().max() < 1e-5


def test_recurrent_rule_matches_transformers():
    _, rec_hf = _hf_rules()
    q, k, v, decay, beta = _inputs(1, 5, b=3)
    s0 = torch.randn(3, SHAPE.num_v_heads, SHAPE.head_k_dim, SHAPE.head_v_dim) * 0.5
    o, s = gdn.recurrent_gated_delta_rule(q, k, v, decay, beta, s0)
    o_ref, s_ref = rec_hf(
        q[:, None], k[:, None], v[:, None], decay[:, None], beta[:, None], initial_state=s0,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert (o - o_ref[:, 0]).abs().max() < 1e-5
    assert (s - s_ref).abs().max() < 1e-5


@pytest.mark.parametrize("split", [1, 5, 63, 64, 65, 100])
def test_split_changes_association_within_bound(split):
    q, k, v, decay, beta = _inputs(150, 9)
    s0 = torch.zeros(SHAPE.num_v_heads, SHAPE.head_k_dim, SHAPE.head_v_dim)
    o, s = gdn.chunk_gated_delta_rule(q, k, v, decay, beta, s0)
    o1, s1 = gdn.chunk_gated_delta_rule(*(x[:split] for x in (q, k, v, decay, beta)), s0)
    o2, s2 = gdn.chunk_gated_delta_rule(*(x[split:] for x in (q, k, v, decay, beta)), s1)
    assert float((s2 - s).norm() / s.norm()) < 1e-5
    assert float((torch.cat([o1, o2]) - o).norm() / o.norm()) < 1e-5


def _pool(live: int = 3, snaps: int = 2) -> StatePool:
    return StatePool.allocate(
        gdn.state_tensors(0, SHAPE) + gdn.state_tensors(2, SHAPE), live, snaps, 8,
        torch.float32, "cpu",
    )  # fmt: skip


def _meta(pool: StatePool, mode: str, rows: list[int], num_valid: int) -> gdn.RecurrentMeta:
    return gdn.RecurrentMeta(mode, torch.tensor(rows), torch.tensor([num_valid]), pool)


def _mix(pool, mode, rows, num_valid, t, seed, layer=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, SHAPE.conv_dim, generator=g)
    w = torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=g) * 0.5
    decay = -torch.rand(t, SHAPE.num_v_heads, generator=g) * 0.3
    beta = torch.rand(t, SHAPE.num_v_heads, generator=g)
    meta = _meta(pool, mode, rows, num_valid)
    return gdn.mix(meta, pool.layer_tensors(layer), SHAPE, x, w, decay, beta), (x, w, decay, beta)


def test_padding_tokens_and_null_rows_write_nothing():
    pool = _pool()
    _mix(pool, "prefill", [1], 50, 64, 1)  # give row 1 some state
    before = [t.clone() for t in pool.tensors]
    _mix(pool, "prefill", [1], 0, 64, 2)  # a chunk of padding only: S and history unchanged
    _mix(pool, "prefill", [NULL_ROW], 64, 64, 3)  # a padded row
    _mix(pool, "decode", [NULL_ROW, NULL_ROW], 0, 2, 4)
    for b, a in zip(before, pool.tensors):
        assert torch.equal(a, b)
    pool.check_integrity()


def test_decode_continues_prefill():
    """Prefill of n tokens then one decode step == prefill of n+1 tokens (other rows idle)."""
    a, b = _pool(), _pool()
    _, (x, w, decay, beta) = _mix(a, "prefill", [2], 40, 64, 7)
    o_full = gdn.mix(_meta(b, "prefill", [2], 41), b.layer_tensors(2), SHAPE, x, w, decay, beta)
    # decode batch [padding, row 2] with token 40
    o_dec = gdn.mix(
        _meta(a, "decode", [NULL_ROW, 2], 1),
        a.layer_tensors(2),
        SHAPE,
        x[39:41],
        w,
        decay[39:41],
        beta[39:41],
    )
    assert (o_dec[1] - o_full[40]).abs().max() < 1e-5
    for ta, tb in zip(a.tensors, b.tensors):
        assert (ta - tb).abs().max() < 1e-5


def test_conv_history_shorter_than_kernel():
    """Chunks shorter than the convolution history keep the older inputs in order."""
    a, b = _pool(), _pool()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, SHAPE.conv_dim, generator=g)
    w = torch.randn(SHAPE.conv_dim, SHAPE.conv_kernel, generator=g)
    d, bt = torch.zeros(64, SHAPE.num_v_heads), torch.full((64, SHAPE.num_v_heads), 0.5)
    whole = gdn.mix(_meta(a, "prefill", [1], 5), a.layer_tensors(0), SHAPE, x, w, d, bt)
    parts = []
    for start, n in ((0, 1), (1, 2), (3, 2)):
        pad = torch.zeros(64 - n, SHAPE.conv_dim)
        xi = torch.cat([x[start : start + n], pad])
        parts.append(
            gdn.mix(_meta(b, "prefill", [1], n), b.layer_tensors(0), SHAPE, xi, w, d, bt)[:n]
        )
    assert (torch.cat(parts) - whole[:5]).abs().max() < 1e-5
    conv_a, conv_b = a.layer_tensors(0)["conv"], b.layer_tensors(0)["conv"]
    assert torch.equal(conv_a[1], conv_b[1])
    assert torch.equal(conv_a[1], x[2:5].T)


def test_pool_regions_fill_copy_and_integrity():
    specs = [
        StateTensor(0, "recurrent", [2, 3]),
        StateTensor(0, "tokens", [2], dtype="int64", fill=7.0),  # e.g. a token-context history
    ]
    pool = StatePool.allocate(specs, 2, 2, 4, torch.float32, "cpu")
    assert pool.num_rows == 5 and pool.first_snapshot_row == 3
    rec, tok = pool.tensors
    assert tok.dtype == torch.int64 and bool((tok == 7).all())
    scatter_rows(rec, torch.tensor([1, 0, 0, 2]), torch.arange(24.0).view(4, 2, 3))
    assert torch.equal(rec[1], torch.arange(6.0).view(2, 3))
    assert torch.equal(rec[2], torch.arange(18.0, 24.0).view(2, 3))
    assert bool((rec[0] == 0).all())
    pool.copy_rows(torch.tensor([2, 0]), torch.tensor([4, 0]))
    assert torch.equal(rec[4], rec[2])
    tok[1] = 3
    pool.fill_rows(torch.tensor([1, 0]))
    assert bool((tok[1] == 7).all()) and bool((rec[1] == 0).all())
    pool.check_integrity()
    rec[0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match="null row"):
        pool.check_integrity()


def test_manifest_without_state_tensors_still_loads(tiny, tmp_path):
    import json
    import shutil

    b = tmp_path / "old"
    shutil.copytree(tiny.bundle("qwen3"), b)
    m = json.loads((b / "manifest.json").read_text())
    m["geometry"].pop("state_tensors", None)  # a manifest written before the field existed
    (b / "manifest.json").write_text(json.dumps(m))
    assert read_manifest(b).geometry.state_tensors == []
    raw = msgspec.json.encode(read_manifest(tiny.bundle("qwen3_5")))
    back = msgspec.json.decode(raw, type=Manifest)
    assert {s.name for s in back.geometry.state_tensors} == {"recurrent", "conv"}
