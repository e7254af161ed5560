"""The fused execution layout (q/k/v and gate/up as one weight each) against the canonical
Transformers forward, for every dense architecture, and against the canonical layout.

fp32 on CPU: fusing only changes which rows one matrix product covers, so the bound stays the
parity bound (1e-5 relative L2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runner_harness import Harness, reference_logits, rel_l2

from prep.bundle import Layout, read_manifest
from prep.components.fused import PreparedLinear, weight_targets
from prep.recipes.dense_modules import FusedGateUpMLP, FusedQKVAttention

TOL = 1e-5


def _prefill_70_in_two_chunks_matches(
    h: Harness, hf: torch.nn.Module, seed: int, sample: bool
) -> None:
    """Row 1 prefills a 70-token prompt as chunks of 40 and 30 (the second samples when
    `sample`); the logits after each chunk match Transformers' forward of the prompt."""
    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(seed)).tolist()
    h.admit(1, prompt)
    h.prefill(1, 0, 40, sample=False)
    ref = reference_logits(hf, prompt)
    assert rel_l2(h.logits(1), ref[39]) < TOL
    h.prefill(1, 40, 30, sample=sample)
    assert rel_l2(h.logits(1), ref[-1]) < TOL


@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "llama", "qwen3"])
def test_fused_layout_matches_transformers(tiny, model_type):
    from transformers import AutoModelForCausalLM

    bundle = tiny.bundle(model_type)
    assert read_manifest(bundle).layout == Layout(fused_qkv=True, fused_gate_up=True)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(model_type), dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(bundle)
    layer = h.r.model.base_model.layers[0]
    assert isinstance(layer.self_attn, FusedQKVAttention)
    assert isinstance(layer.mlp, FusedGateUpMLP)
    assert not hasattr(layer.self_attn, "q_proj")
    assert all(type(m) is not torch.nn.Linear for m in h.r.model.modules())
    _prefill_70_in_two_chunks_matches(h, hf, seed=1, sample=False)
    # the fused weight holds the checkpoint's q/k/v rows exactly, biases included
    hf_attn = hf.model.layers[1].self_attn
    fused = h.r.model.base_model.layers[1].self_attn.qkv_proj
    want = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(fused.weight, want)
    if hf_attn.q_proj.bias is not None:
        want_b = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
        assert torch.equal(fused.bias, want_b)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral", "qwen2"])
def test_fused_decode_layers_match_transformers(tiny, model_type, monkeypatch):
    """decode_gemm="fused": decode steps run each layer as q|k|v(norm1) -> attention -> o +
    residual -> gate|up(norm2) -> down(SiLU * up) + residual (four skinny_fused calls per
    layer; off CUDA the op is the canonical operations), and still match Transformers. Qwen2's
    biased q|k|v keeps the canonical layer."""
    from transformers import AutoModelForCausalLM

    from prep.components import fused as fused_mod
    from prep.recipes import dense_modules

    calls: list[int] = []
    real = dense_modules.skinny_fused

    def counting(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(dense_modules, "skinny_fused", counting)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(model_type), dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(tiny.bundle(model_type), decode_gemm="fused")
    layers = h.r.model.base_model.layers
    fusable = model_type != "qwen2"
    calls.clear()  # the runner's warm-up replays every execution once
    assert all(getattr(layer, "_flare_fused", False) == fusable for layer in layers)
    lens = {1: 9, 2: 40, 5: 17}
    for row, n in lens.items():
        prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(row)).tolist()
        h.admit(row, prompt)
        h.prefill(row, 0, n, sample=True)
    assert not calls  # prefill chunks keep the canonical layer
    for step, rows in enumerate([[1], [2, 5, 1], [5, 2]]):
        h.decode(rows, forced={r: (step * 13 + r) % 500 + 3 for r in rows})
        for r in rows:
            assert rel_l2(h.logits(r), reference_logits(hf, h.seq[r][:-1])[-1]) < TOL, (step, r)
    assert len(calls) == (4 * len(layers) * 3 if fusable else 0)
    # switching back restores the canonical decode layer
    fused_mod.set_decode_gemm(h.r.model, "skinny")
    assert not any(getattr(layer, "_flare_fused", False) for layer in layers)
    with pytest.raises(ValueError, match="unknown decode GEMM"):
        fused_mod.set_decode_gemm(h.r.model, "fastest")


@pytest.mark.parametrize(
    ("model_type", "folded_rows"), [("qwen3", 16), ("llama", 16), ("qwen3", 2)]
)
def test_folded_decode_layers_match_transformers(tiny, model_type, folded_rows, monkeypatch):
    """decode_gemm="folded": each RMSNorm weight is folded into the columns of the projection
    it feeds and gate|up's rows are interleaved, in place, once; decode steps run four
    skinny_folded calls per layer (off CUDA the op's plain-operations contract), prefill
    chunks the canonical layer over the same folded weights, and both still match
    Transformers. With decode_folded_rows = 2 a step of 3 rows (run at capacity 4) takes the
    canonical layer over the folded weights, and matches too. Afterwards "skinny" still
    agrees, "fused" is refused."""
    from transformers import AutoModelForCausalLM

    from prep.components import fused as fused_mod
    from prep.components.skinny_gemm import fold_norm, interleave_pairs
    from prep.recipes import dense_modules

    calls: list[tuple[int, bool, bool]] = []
    real = dense_modules.skinny_folded

    def counting(x, w, norm, eps, pairs, residual):  # type: ignore[no-untyped-def]
        calls.append((x.shape[0], norm, pairs))
        return real(x, w, norm, eps, pairs, residual)

    monkeypatch.setattr(dense_modules, "skinny_folded", counting)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(model_type), dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(tiny.bundle(model_type), decode_gemm="folded", decode_folded_rows=folded_rows)
    layers = h.r.model.base_model.layers
    assert all(layer._flare_folded and layer._flare_weights_folded for layer in layers)
    # the folded weights, exactly: norm weights in the columns, gate|up rows interleaved
    hl, layer = hf.model.layers[1], layers[1]
    want_qkv = torch.cat([hl.self_attn.q_proj.weight, hl.self_attn.k_proj.weight,
                          hl.self_attn.v_proj.weight])  # fmt: skip
    want_qkv = fold_norm(want_qkv, hl.input_layernorm.weight)
    assert torch.equal(layer.self_attn.qkv_proj.weight, want_qkv)
    want_gu = fold_norm(interleave_pairs(hl.mlp.gate_proj.weight, hl.mlp.up_proj.weight),
                        hl.post_attention_layernorm.weight)  # fmt: skip
    assert torch.equal(layer.mlp.gate_up_proj.weight, want_gu)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    calls.clear()  # the runner's warm-up replays every execution once
    lens = {1: 9, 2: 40, 5: 17}
    for row, n in lens.items():
        prompt = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(row)).tolist()
        h.admit(row, prompt)
        h.prefill(row, 0, n, sample=True)
        assert rel_l2(h.logits(row), reference_logits(hf, prompt)[-1]) < TOL, row
    assert not calls  # prefill chunks keep the canonical layer
    step_rows = []  # the rows each step's folded products ran (its capacity), or none
    for step, rows in enumerate([[1], [2, 5, 1], [5, 2]]):
        calls.clear()
        h.decode(rows, forced={r: (step * 13 + r) % 500 + 3 for r in rows})
        for r in rows:
            assert rel_l2(h.logits(r), reference_logits(hf, h.seq[r][:-1])[-1]) < TOL, (step, r)
        per_layer = [(True, False), (False, False), (True, True), (False, False)]
        assert [(n, p) for _, n, p in calls] in ([], per_layer * len(layers)), step
        step_rows.append(sorted({m for m, _, _ in calls}))
    assert step_rows == ([[1], [4], [2]] if folded_rows == 16 else [[1], [], [2]])
    # the same model under the canonical decode layer; the fused prologues cannot read it
    fused_mod.set_decode_gemm(h.r.model, "skinny")
    assert not any(layer._flare_folded for layer in layers)
    h.decode([1], forced={1: 77})
    assert rel_l2(h.logits(1), reference_logits(hf, h.seq[1][:-1])[-1]) < TOL
    with pytest.raises(ValueError, match="folded"):
        fused_mod.set_decode_gemm(h.r.model, "fused")


def test_decode_gemm_gemv_switches_the_narrow_products_and_back(tiny):
    """decode_gemm="gemv" turns on the process-wide switch that routes skinny_linear's narrow
    products to the register GEMV (prep.components.skinny_gemv; CUDA only, so on CPU the model
    still runs F.linear and matches Transformers); any other choice turns it off."""
    pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    from prep.components import fused as fused_mod
    from prep.components import skinny_gemm

    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(tiny.bundle("qwen3"), decode_gemm="gemv")
    try:
        assert skinny_gemm._GEMV["on"]
        prompt = list(range(3, 40))
        h.admit(1, prompt)
        h.prefill(1, 0, len(prompt), sample=True)
        h.decode([1], forced={1: 77})
        assert rel_l2(h.logits(1), reference_logits(hf, h.seq[1][:-1])[-1]) < TOL
    finally:
        fused_mod.set_decode_gemm(h.r.model, "skinny")
    assert not skinny_gemm._GEMV["on"]


def _record_decode_calls(h: Harness) -> list[str]:
    """The names of the decode executions each later step runs (appended as they run)."""
    names: list[str] = []
    for name, call in h.r.calls.items():
        if name.startswith("decode"):

            def run(fn=call.fn, name=name) -> None:  # type: ignore[no-untyped-def]
                names.append(name)
                fn()

            call.fn = run
    return names


@pytest.mark.parametrize("single", ["folded", "folded-gemv"])
def test_single_row_folded_layers_run_only_for_a_lone_request_without_a_seed(
    tiny, monkeypatch, single
):
    """decode_single_gemm="folded" beside decode_gemm="skinny": the weights are folded at load,
    a step that decodes one request without a seed alone runs decode1_single (its _lean form
    for a candidate-path request) and the folded layers; a seeded request alone, and any step
    of two rows, runs the batch-invariant executions (the skinny products over the same folded
    weights). Every step matches Transformers. "folded-gemv": the same, with the GEMV switch
    on exactly while the folded layers run (on CUDA their products take the GEMV; on CPU the
    op's plain operations)."""
    from transformers import AutoModelForCausalLM

    from prep.recipes import dense_modules

    try:
        from prep.components import skinny_gemm

        gemv_on = skinny_gemm._GEMV
    except ImportError:  # without Triton: no switch to watch
        gemv_on = {"on": single == "folded-gemv"}
    calls: list[int] = []
    real = dense_modules.skinny_folded

    def counting(x, w, norm, eps, pairs, residual):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        assert gemv_on["on"] == (single == "folded-gemv")
        return real(x, w, norm, eps, pairs, residual)

    monkeypatch.setattr(dense_modules, "skinny_folded", counting)
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(tiny.bundle("qwen3"), decode_single_gemm=single)
    layers = h.r.model.base_model.layers
    assert all(layer._flare_weights_folded and layer._flare_single_folded for layer in layers)
    assert {"decode1_single", "decode1_lean_single"} <= h.r.calls.keys()
    assert "decode2_single" not in h.r.calls  # one-row executions only
    names = _record_decode_calls(h)
    # row 1: no seed, the full sort; row 2: seeded; row 3: no seed, the candidate path
    params = {1: {"reproducible": False}, 2: {}, 3: {"reproducible": False, "top_k": 20}}
    for row, p in params.items():
        prompt = torch.randint(3, 500, (9 + row,), generator=torch.Generator().manual_seed(row))
        h.admit(row, prompt.tolist(), **p)
        h.prefill(row, 0, len(prompt), sample=True)
    calls.clear()
    want = [([1], "decode1_single", True), ([2], "decode1", False),
            ([3], "decode1_lean_single", True), ([1, 2], "decode2", False),
            ([3, 1], "decode2", False), ([2], "decode1", False)]  # fmt: skip
    for step, (rows, name, folded) in enumerate(want):
        calls.clear()
        names.clear()
        h.decode(rows, forced={r: (step * 13 + r) % 500 + 3 for r in rows})
        assert names == [name], step
        assert calls == ([1] * 4 * len(layers) if folded else []), step
        for r in rows:
            assert rel_l2(h.logits(r), reference_logits(hf, h.seq[r][:-1])[-1]) < TOL, (step, r)


def test_single_row_gemv_runs_the_lone_unseeded_step_inside_the_gemv_switch(tiny):
    """decode_single_gemm="gemv": decode1_single runs inside `single_row_products`, which turns
    skinny_linear's GEMV switch on for that execution only (CUDA launches read it, so a graph
    captured inside keeps the GEMV; on CPU the products stay F.linear and match Transformers);
    the batch-invariant executions run with it off."""
    pytest.importorskip("triton")
    from transformers import AutoModelForCausalLM

    from prep.components import skinny_gemm

    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint("qwen3"), dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(tiny.bundle("qwen3"), decode_single_gemm="gemv")
    assert not skinny_gemm._GEMV["on"]
    seen: list[tuple[bool, bool]] = []
    real = h.r.ex.decode

    def decode(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append((bool(args[4]), skinny_gemm._GEMV["on"]))  # (single_row, switch)
        return real(*args, **kwargs)

    h.r.ex.decode = decode  # type: ignore[method-assign]
    for row, p in ((1, {"reproducible": False}), (2, {})):
        prompt = list(range(3 + row, 30 + row))
        h.admit(row, prompt, **p)
        h.prefill(row, 0, len(prompt), sample=True)
    for rows in ([1], [2], [1, 2]):
        h.decode(rows, forced={r: 70 + r for r in rows})
        for r in rows:
            assert rel_l2(h.logits(r), reference_logits(hf, h.seq[r][:-1])[-1]) < TOL
    assert seen == [(True, True), (False, False), (False, False)]
    assert not skinny_gemm._GEMV["on"]


def test_canonical_layout_still_loads_and_agrees(tiny):
    fused = Harness(tiny.bundle("qwen2"))
    canon_bundle = tiny.bundle("qwen2", fused_layout=False)
    assert read_manifest(canon_bundle).layout == Layout()
    canon = Harness(canon_bundle)
    assert hasattr(canon.r.model.base_model.layers[0].self_attn, "q_proj")
    prompt = list(range(3, 60))
    for h in (fused, canon):
        h.admit(1, prompt)
        h.prefill(1, 0, len(prompt), sample=False)
    assert rel_l2(fused.logits(1), canon.logits(1)) < TOL


def test_weight_targets_address_fused_rows_by_source_name(tiny):
    from prep.model import build_meta_model, load_config

    config = load_config(tiny.checkpoint("qwen3"))
    meta = build_meta_model(config, Layout(fused_qkv=True, fused_gate_up=True))
    targets = weight_targets(meta)
    attn = meta.base_model.layers[0].self_attn
    q = targets["model.layers.0.self_attn.q_proj.weight"]
    k = targets["model.layers.0.self_attn.k_proj.weight"]
    assert q._base is attn.qkv_proj.weight and k._base is attn.qkv_proj.weight
    assert q.shape[0] + 2 * k.shape[0] == attn.qkv_proj.weight.shape[0]
    assert "model.layers.0.self_attn.qkv_proj.weight" not in targets
    assert "model.layers.0.mlp.gate_proj.weight" in targets
    assert isinstance(attn.qkv_proj, PreparedLinear)


_HYBRID_LAYOUT = Layout(fused_qkv=True, fused_gate_up=True, fused_gdn_in=True)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_hybrid_fused_layout_matches_transformers_and_the_canonical_layout(tiny, model_type):
    """Gated DeltaNet input projections, gated attention q|k|v and dense (or shared-expert) MLP
    gate|up each as one weight: the same logits as Transformers and as the canonical layout,
    and every fused row range equal to its checkpoint tensor."""
    from transformers import AutoModelForCausalLM

    from prep.recipes.hybrid import _DENSE_MLPS, PreparedGatedDeltaNet

    bundle = tiny.bundle(model_type)
    assert read_manifest(bundle).layout == _HYBRID_LAYOUT
    canon_bundle = tiny.bundle(model_type, fused_layout=False)
    assert read_manifest(canon_bundle).layout == Layout()
    hf = AutoModelForCausalLM.from_pretrained(
        tiny.checkpoint(model_type), dtype=torch.float32, attn_implementation="eager"
    )
    fused, canon = Harness(bundle), Harness(canon_bundle)
    model = fused.r.model
    types = model.config.layer_types
    gdn = [m for m in model.modules() if isinstance(m, PreparedGatedDeltaNet)]
    assert len(gdn) == types.count("linear_attention")
    assert all(m.in_split and not hasattr(m, m.inputs[0]) for m in gdn)
    attn = [m for m in model.modules() if isinstance(m, FusedQKVAttention)]
    assert len(attn) == types.count("full_attention") and all(m.output_gate for m in attn)
    mlps = [m for m in model.modules() if isinstance(m, FusedGateUpMLP)]
    assert len(mlps) == len(types)  # one dense MLP or one shared expert per layer
    assert not any(type(m).__name__ in _DENSE_MLPS for m in model.modules())

    prompt = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = reference_logits(hf, prompt)
    for h in (fused, canon):
        h.admit(1, prompt)
        h.prefill(1, 0, 40, sample=False)
        assert rel_l2(h.logits(1), ref[39]) < TOL
        h.prefill(1, 40, 30, sample=False)
        assert rel_l2(h.logits(1), ref[-1]) < TOL
    assert rel_l2(fused.logits(1), canon.logits(1)) < TOL

    i = types.index("linear_attention")
    hf_gdn, ours = hf.model.layers[i].linear_attn, model.base_model.layers[i].linear_attn
    want = torch.cat([getattr(hf_gdn, n).weight for n in ours.inputs])
    assert torch.equal(ours.in_proj.weight, want)
    j = types.index("full_attention")
    hf_attn = hf.model.layers[j].self_attn
    want = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(model.base_model.layers[j].self_attn.qkv_proj.weight, want)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_a_sliding_window_is_kept_as_the_canonical_attention_applies_it(tiny, tmp_path, model_type):
    """Mistral's attention reads `config.sliding_window` when it runs (no per-layer attribute,
    no layer_types; Mistral-7B-v0.1 ships a 4,096 window), Qwen2's only with
    use_sliding_window. The bundle declares the window (the runner then picks the attention
    backend that implements it), and prefill and decode past it match Transformers."""
    from transformers import AutoModelForCausalLM

    from prep.prepare import PrepConfig, prepare
    from prep.tiny import make_tiny_checkpoint

    overrides: dict[str, object] = {"sliding_window": 24}
    if model_type == "qwen2":  # its config derives layer_types at construction
        overrides.update(use_sliding_window=True, layer_types=["sliding_attention"] * 2)
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", model_type, config_overrides=overrides)
    bundle = tmp_path / "bundle"
    prepare(PrepConfig(checkpoint=ckpt, out=bundle, max_context_tokens=256,
                       max_prefill_chunk_tokens=64, page_size=16, compile=False, device="cpu"))  # fmt: skip
    assert read_manifest(bundle).geometry.sliding_window == 24
    hf = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    h = Harness(bundle)
    assert all(layer.self_attn.sliding_window == 24 for layer in h.r.model.base_model.layers)
    _prefill_70_in_two_chunks_matches(h, hf, seed=3, sample=True)
    for step in range(3):  # decode steps, 70+ tokens into a 24-token window
        h.decode([1], forced={1: 7 * step + 11})
        assert rel_l2(h.logits(1), reference_logits(hf, h.seq[1][:-1])[-1]) < TOL, step


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_a_window_the_context_limit_cannot_reach_is_dropped(tiny, tmp_path, model_type):
    """A window at least the bundle's context limit never hides a key: prep switches it off in
    the bundle's config and geometry (so CUDA keeps the paged kernels), and the bundle still
    matches Transformers with the window declared. One token less than the limit keeps it."""
    from transformers import AutoModelForCausalLM

    from prep.prepare import PrepConfig, prepare
    from prep.tiny import make_tiny_checkpoint

    def ckpt_with(window: int) -> Path:
        overrides: dict[str, object] = {"sliding_window": window}
        if model_type == "qwen2":
            overrides.update(use_sliding_window=True, layer_types=["sliding_attention"] * 2)
        return make_tiny_checkpoint(
            tmp_path / f"ckpt{window}", model_type, config_overrides=overrides
        )

    def prep(ckpt: Path, name: str) -> Path:
        prepare(PrepConfig(checkpoint=ckpt, out=tmp_path / name, max_context_tokens=128,
                           max_prefill_chunk_tokens=64, page_size=16, compile=False,
                           device="cpu"))  # fmt: skip
        return tmp_path / name

    assert read_manifest(prep(ckpt_with(127), "kept")).geometry.sliding_window == 127
    ckpt = ckpt_with(128)
    bundle = prep(ckpt, "dropped")
    assert read_manifest(bundle).geometry.sliding_window is None
    served = json.loads((bundle / "config.json").read_text())
    assert served.get("sliding_window") is None
    assert "sliding_attention" not in (served.get("layer_types") or [])
    hf = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    assert hf.config.sliding_window == 128  # the reference keeps its window
    h = Harness(bundle)
    assert all(layer.self_attn.sliding_window is None for layer in h.r.model.base_model.layers)
    _prefill_70_in_two_chunks_matches(h, hf, seed=3, sample=True)
    for step in range(3):
        h.decode([1], forced={1: 7 * step + 11})
        assert rel_l2(h.logits(1), reference_logits(hf, h.seq[1][:-1])[-1]) < TOL, step
