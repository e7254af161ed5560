"""flare prep on Gated DeltaNet hybrids: the declared geometry and the recipe's validation."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from prep.bundle import read_manifest
from prep.errors import UnsupportedModel
from prep.prepare import PrepConfig, prepare


@pytest.mark.parametrize(
    ("model_type", "arch"),
    [("qwen3_next", "Qwen3NextForCausalLM"), ("qwen3_5", "Qwen3_5ForCausalLM")],
)
def test_prep_cli_declares_the_state_layout(tiny, tmp_path, model_type, arch):
    out = tmp_path / "b"
    run = subprocess.run(
        [sys.executable, "-m", "prep", str(tiny.checkpoint(model_type)), "--out", str(out),
         "--device", "cpu", "--max-context", "256", "--prefill-chunk", "128", "--no-compile"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    m = read_manifest(out)
    g = m.geometry
    assert m.architecture == arch
    assert g.attention_layers == [2]  # the tiny layout: linear, linear, full, linear
    assert g.num_kv_heads == 2 and g.head_dim == 32
    by_layer = {(s.layer, s.name): s for s in g.state_tensors}
    assert sorted(by_layer) == [(i, n) for i in (0, 1, 3) for n in ("conv", "recurrent")]
    rec, conv = by_layer[(0, "recurrent")], by_layer[(0, "conv")]
    assert rec.shape == [4, 16, 16] and rec.dtype == "float32" and rec.fill == 0.0
    assert conv.shape == [2 * 2 * 16 + 4 * 16, 3] and conv.dtype == "execution"
    assert g.state_row_bytes(4) == 3 * (4 * 16 * 16 * 4 + 128 * 3 * 4)
    assert m.sampling_defaults.top_k == 20


def _edited(tiny, tmp_path, **changes):
    ck = tmp_path / "ck"
    shutil.copytree(tiny.checkpoint("qwen3_5"), ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(changes)
    (ck / "config.json").write_text(json.dumps(cfg))
    return PrepConfig(checkpoint=ck, out=tmp_path / "b", compile=False, device="cpu",
                      max_context_tokens=256, max_prefill_chunk_tokens=128)  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"linear_num_value_heads": 3}, "linear value heads"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "dynamic",
        ),
    ],
)
def test_unsupported_hybrid_variants_fail_clearly(tiny, tmp_path, changes, needle):
    with pytest.raises(UnsupportedModel, match=needle):
        prepare(_edited(tiny, tmp_path, **changes))
