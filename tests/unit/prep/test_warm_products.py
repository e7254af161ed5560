"""Prep's compile warm-up traces the graphs the daemon will run with its default engine
options: on CUDA `decode_single_gemm = "auto"` folds the weights and adds the one-row
executions for requests without a seed, so the warm-up must do the same or the daemon compiles
them at every start (under systemd the bundle, where the compile cache lives, is read-only)."""

from __future__ import annotations

import torch

from flared.engine_config import EngineConfig
from flared.runner.sizing import plan_runner
from prep.bundle import read_manifest
from prep.model import DTYPES, build_model, load_config, load_weights
from prep.warm import warm_decode_products


def _model(bundle):
    m = read_manifest(bundle)
    model = build_model(load_config(bundle), torch.device("cpu"), DTYPES[m.dtype], m.layout)
    load_weights(model, [bundle / f for f in sorted({t.file for t in m.tensors})])
    return model


def test_the_warm_up_sets_the_products_the_default_daemon_runs(tiny):
    bundle = tiny.bundle("qwen3")
    layers = lambda model: model.base_model.layers  # noqa: E731
    cpu = _model(bundle)
    assert warm_decode_products(cpu, "cpu") == "none"
    assert plan_runner(bundle, EngineConfig(device="cpu")).decode_single_gemm == "none"
    assert not any(getattr(layer, "_flare_folded", False) for layer in layers(cpu))
    # on CUDA: what plan_runner resolves "auto" to there, with the weights folded as the
    # runner's set_decode_gemm folds them (gate and up rows interleaved, the norms' weights
    # inside the projections)
    cuda = _model(bundle)
    assert warm_decode_products(cuda, "cuda") == "folded-gemv"
    for folded, plain in zip(layers(cuda), layers(cpu), strict=True):
        assert folded._flare_folded
        assert not torch.equal(folded.mlp.gate_up_proj.weight, plain.mlp.gate_up_proj.weight)
        assert torch.equal(
            folded.mlp.gate_up_proj.weight.sort(dim=0).values,
            (plain.mlp.gate_up_proj.weight * plain.post_attention_layernorm.weight)
            .sort(dim=0)
            .values,
        )
