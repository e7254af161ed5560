"""flare prep on checkpoints as published: vision-language wrappers served as text, experts
stored one tensor each, multi-token-prediction heads, several shards.

Each published tiny checkpoint holds exactly the weights of the same-seed checkpoint in
Transformers' in-memory layout, so the two bundles must be the same bundle: byte-identical
weights, the same config and manifest, differing only in the recorded source.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from prep.bundle import read_manifest
from prep.errors import UnsupportedModel
from prep.prepare import PrepConfig, prepare
from prep.tiny import make_tiny_checkpoint

HYBRIDS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
VISION = "vision encoder: image and video inputs are not served yet"
MTP = "multi-token-prediction head: Flare does not run speculative decoding"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    made: dict[str, Path] = {}

    def get(model_type: str) -> Path:
        if model_type not in made:
            made[model_type] = make_tiny_checkpoint(root / model_type, model_type, published=True)
        return made[model_type]

    return get


def _prep(ckpt: Path, out: Path):
    return prepare(PrepConfig(checkpoint=ckpt, out=out, compile=False, device="cpu",
                              max_context_tokens=512, max_prefill_chunk_tokens=256))  # fmt: skip


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_published_checkpoint_gives_the_same_bundle(tiny, published, tmp_path, model_type):
    from transformers import AutoConfig

    mem_bundle = tiny.bundle(model_type)
    pub = published(model_type)
    pub_bundle = tmp_path / "b"
    m = _prep(pub, pub_bundle)
    assert filecmp.cmp(mem_bundle / "weights" / "model.safetensors",
                       pub_bundle / "weights" / "model.safetensors", shallow=False)  # fmt: skip
    ref = read_manifest(mem_bundle)
    provenance = {"created_utc", "checkpoint_fingerprint", "source"}
    ours, theirs = msgspec.to_builtins(m), msgspec.to_builtins(ref)
    assert {k: v for k, v in ours.items() if k not in provenance} == {
        k: v for k, v in theirs.items() if k not in provenance
    }
    configs = [AutoConfig.from_pretrained(b).to_dict() for b in (mem_bundle, pub_bundle)]
    for c in configs:
        c.pop("_name_or_path")
    assert configs[0] == configs[1]

    src = m.source
    assert src is not None and ref.source is not None
    declared = json.loads((pub / "config.json").read_text())["architectures"][0]
    assert src.architecture == declared and ref.source.architecture == ref.architecture
    names = [n for f in sorted(pub.glob("*.safetensors")) for n in load_file(str(f))]
    listed = [n for nl in src.not_loaded for n in nl.tensors]
    assert src.num_stored + src.num_stacked + len(listed) == src.num_tensors == len(names)
    by_reason = {nl.reason: nl.tensors for nl in src.not_loaded}
    assert by_reason[MTP] == sorted(n for n in names if n.startswith("mtp."))
    visual = sorted(n for n in names if n.startswith("model.visual."))
    assert by_reason.get(VISION, []) == visual and (bool(visual) == (model_type != "qwen3_next"))
    per_expert = [n for n in names if ".mlp.experts." in n and n.split(".")[-3].isdigit()]
    assert src.num_stacked == len(per_expert) == (0 if model_type == "qwen3_5" else 3 * 4 * 4)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe"])
def test_stacked_experts_equal_transformers_conversion(published, tmp_path, model_type):
    """Transformers' own loader converts the same published checkpoint to the same tensors."""
    from transformers import AutoModelForCausalLM

    pub = published(model_type)
    _prep(pub, tmp_path / "b")
    ours = load_file(str(tmp_path / "b" / "weights" / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(pub, dtype=torch.float32).state_dict()
    stacked = [n for n in ours if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacked) == 2 * 4
    for name, t in ours.items():
        assert torch.equal(t, hf[name]), name


def _edit_shards(ckpt: Path, edit) -> None:
    """Apply `edit(tensors) -> tensors` to every shard of the checkpoint."""
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors = load_file(str(f))
        save_file(edit(dict(tensors)), str(f), metadata={"format": "pt"})


def _expert(name: str, e: int, part: str) -> str:
    return f"model.language_model.layers.{name}.mlp.experts.{e}.{part}.weight"


def test_missing_and_surplus_experts_are_named(published, tmp_path):
    pub = published("qwen3_5_moe")
    gone = _expert("1", 3, "up_proj")
    ck = _copy(pub, tmp_path / "missing")
    _edit_shards(ck, lambda ts: {k: v for k, v in ts.items() if k != gone})
    with pytest.raises(UnsupportedModel, match=r"layers\.1\.mlp\.experts\.gate_up_proj: the "
                       r"checkpoint is missing up_proj of experts \[3\] \(the config declares 4"):  # fmt: skip
        _prep(ck, tmp_path / "b1")

    ck = _copy(pub, tmp_path / "surplus")
    first = sorted(ck.glob("model-0*.safetensors"))[0]
    ts = load_file(str(first))
    ts[_expert("0", 4, "down_proj")] = torch.zeros(64, 32)
    save_file(ts, str(first), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match=r"experts beyond the 4 the config declares.*"
                       r"experts\.4\.down_proj"):  # fmt: skip
        _prep(ck, tmp_path / "b2")


def test_expert_shape_and_double_layout_are_refused(published, tmp_path):
    pub = published("qwen3_next")
    name = "model.layers.3.mlp.experts.2.gate_proj.weight"
    ck = _copy(pub, tmp_path / "shape")
    _edit_shards(ck, lambda ts: {k: (v[:16] if k == name else v) for k, v in ts.items()})
    with pytest.raises(UnsupportedModel, match=r"experts\.2\.gate_proj\.weight: checkpoint shape "
                       r"\(16, 64\) != \(32, 64\), its slice of"):  # fmt: skip
        _prep(ck, tmp_path / "b1")

    ck = _copy(pub, tmp_path / "both")
    first = sorted(ck.glob("model-0*.safetensors"))[0]
    ts = load_file(str(first))
    ts["model.layers.3.mlp.experts.gate_up_proj"] = torch.zeros(4, 64, 64)
    save_file(ts, str(first), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="both whole and as per-index tensors"):
        _prep(ck, tmp_path / "b2")


def _edit_config(ckpt: Path, edit) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    edit(cfg)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def test_wrapper_tying_follows_the_published_class(published, tmp_path):
    """The wrapper's top-level tie_word_embeddings decides, as Transformers ties the published
    class's head; a head missing from an untied checkpoint is named."""
    pub = published("qwen3_5")  # tied: no lm_head.weight in the checkpoint
    ck = _copy(pub, tmp_path / "tie")
    _edit_config(ck, lambda c: c["text_config"].update(tie_word_embeddings=False))
    m = _prep(ck, tmp_path / "b1")
    assert ["lm_head.weight", "model.embed_tokens.weight"] in m.tied_parameters
    assert json.loads((tmp_path / "b1" / "config.json").read_text())["tie_word_embeddings"]

    _edit_config(ck, lambda c: c.update(tie_word_embeddings=False))
    with pytest.raises(UnsupportedModel, match=r"\['lm_head\.weight'\] are missing"):
        _prep(ck, tmp_path / "b2")


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c.update(quantization_config={"quant_method": "fp8"}), "quantized.*'fp8'"),
        (lambda c: c.update(architectures=["Qwen3VLForConditionalGeneration"]),
         "'Qwen3VLForConditionalGeneration' is not supported.*Qwen3_5ForConditionalGeneration"),
        (lambda c: c["text_config"].update(linear_num_value_heads=3), "3 linear value heads"),
    ],
)  # fmt: skip
def test_unsupported_published_variants_fail_clearly(published, tmp_path, edit, needle):
    ck = _copy(published("qwen3_5_moe"), tmp_path / "ck")
    _edit_config(ck, edit)
    with pytest.raises(UnsupportedModel, match=needle):
        _prep(ck, tmp_path / "b")


def test_unknown_language_model_tensor_is_refused(published, tmp_path):
    ck = _copy(published("qwen3_5"), tmp_path / "ck")
    first = sorted(ck.glob("model-0*.safetensors"))[0]
    ts = load_file(str(first))
    ts["model.language_model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(ts, str(first), metadata={"format": "pt"})
    with pytest.raises(
        UnsupportedModel, match=r"no place in the model.*language_model\.layers\.0\.extra"
    ):
        _prep(ck, tmp_path / "b")


def test_prep_report_lists_what_is_not_loaded(published, tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "prep", str(published("qwen3_5_moe")), "--out", str(tmp_path / "b"),
         "--device", "cpu", "--max-context", "256", "--prefill-chunk", "128", "--no-compile"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "prepared Qwen3_5MoeForCausalLM" in run.stdout
    assert "not loaded: 21 tensors" in run.stdout and VISION in run.stdout
    assert "48 per-index tensors stacked" in run.stdout


def test_converted_prep_peak_memory_is_bounded(tmp_path):
    """Per-expert tensors stream into their slices: the child's peak RSS growth over prep stays
    below 1.2x (in fact far below) the weights of a (synthetic, larger) sharded per-expert
    checkpoint.

    The peak is the kernel's VmHWM, reset to the current RSS once the modules prep imports are
    loaded (a child's ru_maxrss starts at its parent's peak, which hides the growth)."""
    ck = make_tiny_checkpoint(tmp_path / "big", "qwen3_next", published=True,
                              config_overrides={"hidden_size": 512, "num_experts": 20,
                                                "moe_intermediate_size": 256,
                                                "shared_expert_intermediate_size": 256})  # fmt: skip
    code = (
        "from pathlib import Path\n"
        "from prep.model import build_meta_model, load_config\n"
        "from prep.prepare import PrepConfig, prepare\n"
        "from prep.recipes import read_checkpoint\n"
        "from prep.rss import peak_rss_bytes as hwm\n"
        f"ck = Path({str(ck)!r})\n"
        "build_meta_model(read_checkpoint(load_config(ck)).config)  # imports: not measured\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # peak RSS := current RSS\n"
        "base = hwm()\n"
        f"m = prepare(PrepConfig(checkpoint=ck, out=Path({str(tmp_path / 'bb')!r}), "
        "compile=False, device='cpu', max_context_tokens=512, max_prefill_chunk_tokens=256))\n"
        "print(hwm() - base, m.weight_bytes, m.source.num_stacked)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth, weight_bytes, stacked = map(int, out.stdout.strip().splitlines()[-1].split())
    assert stacked == 4 * 20 * 3 and weight_bytes > 100 * 2**20
    assert growth < 1.2 * weight_bytes, (growth, weight_bytes)
    # one source tensor at a time, read without a memory map: measured 0.03x here
    assert growth < 0.2 * weight_bytes, (growth, weight_bytes)


def test_bundles_without_a_source_account_still_load(tiny, tmp_path):
    """`Manifest.source` is additive: a format-1 bundle written before it loads with None."""
    b = tmp_path / "older"
    shutil.copytree(tiny.bundle("qwen3_5"), b)
    m = json.loads((b / "manifest.json").read_text())
    assert m.pop("source")["architecture"] == "Qwen3_5ForCausalLM"
    (b / "manifest.json").write_text(json.dumps(m))
    older = read_manifest(b)
    assert older.source is None and older.format_version == 1
    assert older.tensors == read_manifest(tiny.bundle("qwen3_5")).tensors


def test_tensors_the_model_class_ignores_are_listed(tiny, tmp_path):
    """A tensor Transformers' class skips on load (its _keys_to_ignore_on_load_unexpected) is
    reported with the pattern, never dropped silently."""
    ck = _copy(tiny.checkpoint("qwen3_5"), tmp_path / "ck")
    ts = load_file(str(ck / "model.safetensors"))
    ts["model.visual.extra.weight"] = torch.zeros(3)
    save_file(ts, str(ck / "model.safetensors"), metadata={"format": "pt"})
    src = _prep(ck, tmp_path / "b").source
    assert src is not None and src.num_tensors == len(ts)
    (nl,) = src.not_loaded
    assert nl.tensors == ["model.visual.extra.weight"] and nl.source_bytes == 12
    assert nl.reason == "ignored by the Transformers model class (pattern '^model.visual.*')"
