"""GPU: the Gated DeltaNet kernels vs the PyTorch reference, and a hybrid (Qwen3.5-style) model
through the runner with CUDA graphs vs Transformers. Run with `-m gpu`.

Bounds. Decode kernel vs reference on fp32 inputs: the same rule with another reduction order
over Dk, so fp32 rounding (asserted 1e-5 relative L2). Chunked prefill (flash-linear-attention,
tensor-core dots in lower precision) vs the fp32 reference chunk: measured and printed, asserted
2e-2 relative L2, the order of bf16 rounding. The whole bf16 model vs fp32 Transformers:
asserted within 3x Transformers' own bf16 error (as the dense test does).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


from gpu_support import rel_l2 as _rel  # noqa: E402


def _pools(shape, dev):
    from prep.components import gated_deltanet as gdn
    from prep.components.state_pool import StatePool

    specs = gdn.state_tensors(0, shape)
    a = StatePool.allocate(specs, 6, 2, 64, torch.float32, dev)
    for t in a.tensors:
        t[1:].normal_(0, 0.5)
    b = StatePool.allocate(specs, 6, 2, 64, torch.float32, dev)
    for src, dst in zip(a.tensors, b.tensors):
        dst.copy_(src)
    return a, b


@pytest.mark.parametrize("heads", [(16, 32, 128, 128), (2, 4, 64, 64)])
def test_gdn_kernels_match_reference(heads):
    from prep.components import gated_deltanet as gdn
    from prep.components.gdn_triton import TritonGDN

    hk, hv, dk, dv = heads
    dev = "cuda"
    torch.manual_seed(0)
    shape = gdn.GDNShape(hk, hv, dk, dv, conv_kernel=4)
    backend = TritonGDN()
    assert backend._chunk is not None, "flash-linear-attention must be installed on CUDA"
    weight = torch.randn(shape.conv_dim, 4, device=dev) * 0.5
    # decode: 4 rows, one of them padding
    mine, ref = _pools(shape, dev)
    before = [t.clone() for t in mine.tensors]
    rows = torch.tensor([3, 0, 1, 5], device=dev)
    x = torch.randn(4, shape.conv_dim, device=dev)
    g = -torch.rand(4, hv, device=dev) * 0.3
    beta = torch.rand(4, hv, device=dev)
    o = backend.mix(
        gdn.RecurrentMeta("decode", rows, None, mine),
        mine.layer_tensors(0),
        shape,
        x,
        weight,
        g,
        beta,
    )
    o_ref = gdn.REFERENCE.mix(gdn.RecurrentMeta("decode", rows, None, ref), ref.layer_tensors(0), shape, x, weight,
                              g, beta)  # fmt: skip
    live = rows != 0
    print(f"decode {heads}: out {_rel(o[live], o_ref[live]):.2e}")
    assert _rel(o[live], o_ref[live]) < 1e-5
    for t, r, t0 in zip(mine.tensors, ref.tensors, before):
        assert _rel(t, r) < 1e-5
        for untouched in (0, 2, 4, 6, 7, 8):
            assert torch.equal(t[untouched], t0[untouched])
    # prefill: one row, a padded chunk (num_valid < T), then a second chunk from the result
    mine, ref = _pools(shape, dev)
    row = torch.tensor([2], device=dev)
    for t_len, valid in ((256, 200), (128, 128)):
        x = torch.randn(t_len, shape.conv_dim, device=dev)
        g = -torch.rand(t_len, hv, device=dev) * 0.3
        beta = torch.rand(t_len, hv, device=dev)
        nv = torch.tensor([valid], device=dev)
        o = backend.mix(
            gdn.RecurrentMeta("prefill", row, nv, mine),
            mine.layer_tensors(0),
            shape,
            x,
            weight,
            g,
            beta,
        )
        o_ref = gdn.REFERENCE.mix(gdn.RecurrentMeta("prefill", row, nv, ref), ref.layer_tensors(0), shape, x,
                                  weight, g, beta)  # fmt: skip
        e_o = _rel(o[:valid], o_ref[:valid])
        e_s = _rel(mine.tensors[0][2], ref.tensors[0][2])
        print(f"prefill {heads} T={t_len} valid={valid}: out {e_o:.2e} state {e_s:.2e}")
        assert e_o < 2e-2 and e_s < 2e-2
        assert torch.equal(mine.tensors[1][2], ref.tensors[1][2].to(mine.tensors[1].dtype))


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def hybrid_bundle(request, tmp_path_factory):
    """The dense-MLP family and the routed-MoE one (Transformers' grouped experts: static
    shapes, so the MoE layers must capture into CUDA graphs like the rest)."""
    from gpu_support import tiny_cuda_bundle

    overrides = {
        "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    }  # fmt: skip
    if request.param == "qwen3_next":
        overrides |= {"moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
    root = tmp_path_factory.mktemp(f"gpu-hybrid-{request.param}")
    return (request.param, *tiny_cuda_bundle(root, request.param, overrides))


# conv_kernel=True: the whole bf16 hybrid with the one-launch convolution (gdn_conv_prefill).
# It drifted once (rel L2 1.4 on the H200, 2026-12-03) and was pinned as an expected failure;
# on 2026-12-04 it passed (4.8e-2, within the bound) without a change to the kernel, after the
# runner stopped entering and leaving a stream context around every step (4.8e-2 again on
# 2026-12-04 with the kernel on by default, 6.1e-2 without it). Both cases stay required.
@pytest.mark.parametrize("conv_kernel", [False, True])
def test_hybrid_bf16_forward_matches_transformers_and_graphs_replay(
    hybrid_bundle, conv_kernel, monkeypatch
):
    import importlib

    from gpu_support import worst_logits_error
    from transformers import AutoModelForCausalLM

    from flared.runner.runner import ModelRunner, RunnerPlan
    from prep.components import gdn_triton

    family, ckpt, bundle = hybrid_bundle
    if conv_kernel and family != "qwen3_5":
        pytest.skip("one family shows the convolution kernel's effect")
    monkeypatch.setattr(gdn_triton, "CONV_KERNEL", conv_kernel)
    hf_mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    # Transformers' own torch path as the reference: its flash-linear-attention binding would
    # re-tune its kernels for every new sequence length (minutes over this loop)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        fn = getattr(hf_mod, name)
        setattr(hf_mod, name, getattr(fn, "__wrapped__", fn))
    r = ModelRunner(
        bundle,
        RunnerPlan("cuda", 128, 4, compile=False, cuda_graphs=True, attention_backend="triton"),
    )
    assert all(c.graph is not None for c in r.calls.values())
    assert r.ex.recurrent_backend is not None
    # every prefill capacity was timed (on fresh request state) for the scheduler's chunk cut
    assert sorted(r.prefill_ms) == r.manifest.catalog.prefill_capacities
    assert all(t > 0 for t in r.prefill_ms.values())
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda()
    hf32 = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).cuda()
    ps = r.page_size
    g = torch.Generator().manual_seed(1)
    prompts = {1: torch.randint(3, 500, (300,), generator=g).tolist(),
               2: torch.randint(3, 500, (ps * 3,), generator=g).tolist()}  # fmt: skip
    pages = {1: list(range(40, 62)), 2: [0, 1, 2, 30, 31]}
    # row 1 crosses a chunk boundary (256): its recurrent state carries over
    worst, worst16 = worst_logits_error(r, hf, hf32, prompts, pages, 256, decode_steps=10)
    print(f"{family} bf16 rel L2 vs fp32: flare {worst:.2e}, transformers-bf16 {worst16:.2e}")
    assert worst < max(3 * worst16, 2e-2)


@pytest.mark.parametrize("dk", [64, 16])
def test_gdn_conv_prefill_replays_in_a_cuda_graph(dk):
    """The one-launch convolution captured in a CUDA graph, replayed over new inputs and valid
    counts, equals the PyTorch path computed afterwards (bf16, strided rows, history gathered
    from a pool inside the graph, as the prefill execution does). Head width 16 is the tiny
    test model's, whose whole forward drifts with the kernel while width 64 passed here."""
    from prep.components import gdn_triton as gt

    torch.manual_seed(0)
    hk, hv, dv = 2, 4, dk
    key_dim, t = hk * dk, 256
    c = 2 * key_dim + hv * dv
    wide = torch.randn(t, c + 264, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(6, c, 3, device="cuda")
    rows = torch.tensor([1], device="cuda")
    weight = (torch.randn(c, 1, 4, device="cuda") * 0.5).to(torch.bfloat16)
    num_valid = torch.tensor([t], device="cuda")

    def run():
        hist = pool.index_select(0, rows)[0]
        return gt.gdn_conv_prefill(wide[:, :c], hist, weight[:, 0], num_valid, key_dim, dk)

    run()
    torch.cuda.synchronize()
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = run()
    assert not gt._ConvKernel.failed
    for n in (t, 44, 2):
        wide.normal_()
        pool.normal_()
        num_valid.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        ref = gt.conv_prefill_unfused(wide[:, :c], pool[1], weight[:, 0], num_valid, key_dim, dk)
        for got, want in zip(out, ref):
            assert _rel(got, want) < 1e-3, n


def test_row_copies_match_the_torch_path():
    """Snapshot/restore row copies and tail-page copies (one launch each on CUDA) are bit-exact
    against the per-tensor torch path, and skip padding."""
    from prep.components import gated_deltanet as gdn
    from prep.components.state_pool import scatter_rows

    shape = gdn.GDNShape(16, 32, 128, 128, conv_kernel=4)
    mine, ref = _pools(shape, "cuda")
    src = torch.tensor([1, 2, 0], device="cuda")
    dst = torch.tensor([7, 8, 0], device="cuda")
    mine.copy_rows(src, dst)
    for t in ref.tensors:
        scatter_rows(t, dst, t.index_select(0, src))
    assert all(torch.equal(a, b) for a, b in zip(mine.tensors, ref.tensors))
    kv = [torch.randn(9, 16, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    from prep.components.row_copy import RowTable

    before = [t.clone() for t in kv]
    RowTable(kv).copy(torch.tensor([3, 8], device="cuda"), torch.tensor([5, 8], device="cuda"), 8)
    for t, t0 in zip(kv, before):
        expect = t0.clone()
        expect[5] = t0[3]
        assert torch.equal(t, expect)
