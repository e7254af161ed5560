"""flare prep: validation, tensor accounting, catalog, bundle format and its versioning."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prep.bundle import BundleError, read_manifest
from prep.errors import InvalidCapacity, PrepError, UnsupportedModel
from prep.prepare import PrepConfig, prefill_capacities, prepare


def test_bundle_manifest_is_typed_and_complete(tiny):
    b = tiny.bundle("qwen3")
    m = read_manifest(b)
    assert m.format_version == 1
    assert m.architecture == "Qwen3ForCausalLM"
    assert m.catalog.decode_capacities == [1, 2, 4, 8]
    assert m.catalog.prefill_capacities == [128, 256]
    assert m.geometry.num_kv_heads == 2 and m.geometry.head_dim == 16
    assert m.frontend.eos_token_ids and m.frontend.chat_template
    # tied embeddings are stored once and declared as a tied group
    assert ["lm_head.weight", "model.embed_tokens.weight"] in m.tied_parameters
    names = {t.name for t in m.tensors}
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert (b / "frontend" / "tokenizer.json").is_file()
    assert m.sampling_defaults.temperature == 0.6 and m.sampling_defaults.top_k == 20


def test_execution_weights_equal_checkpoint(tiny):
    from safetensors.torch import load_file

    ckpt = tiny.checkpoint("llama")
    b = tiny.bundle("llama")
    src = load_file(str(ckpt / "model.safetensors"))
    dst = load_file(str(b / "weights" / "model.safetensors"))
    assert set(src) == set(dst)
    for k in src:
        assert src[k].dtype == dst[k].dtype and bool((src[k] == dst[k]).all()), k


def test_prefill_capacity_catalog():
    assert prefill_capacities(128) == [128]
    assert prefill_capacities(512) == [128, 256, 512]
    assert prefill_capacities(640) == [128, 256, 512, 640]
    assert prefill_capacities(4096)[-1] == 4096


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_prefill_chunk_tokens": 100}, "multiple of 64"),
        (
            {"max_prefill_chunk_tokens": 1024, "max_context_tokens": 512},
            "between 64 and the context",
        ),
        ({"max_context_tokens": 8192}, "max_position_embeddings"),
        ({"page_size": 12}, "power of two"),
        ({"decode_capacities": (0, 2)}, "decode capacities"),
        ({"extra_prefill_capacities": (200,)}, "multiple of 64 between 64 and the chunk"),
        ({"extra_prefill_capacities": (320,)}, "multiple of 64 between 64 and the chunk"),
    ],
)
def test_invalid_capacities_fail_clearly(tiny, tmp_path, kw, needle):
    cfg = PrepConfig(checkpoint=tiny.checkpoint("qwen3"), out=tmp_path / "b", compile=False,
                     device="cpu", **{"max_context_tokens": 512, "max_prefill_chunk_tokens": 256, **kw})  # fmt: skip
    if "max_position_embeddings" in needle:
        cfg = PrepConfig(checkpoint=tiny.checkpoint("qwen3"), out=tmp_path / "b", compile=False,
                         device="cpu", max_context_tokens=8192, max_prefill_chunk_tokens=256)  # fmt: skip
    with pytest.raises(InvalidCapacity, match=needle):
        prepare(cfg)


def _copy_ckpt(tiny, tmp_path, model_type="qwen3"):
    dst = tmp_path / "ck"
    shutil.copytree(tiny.checkpoint(model_type), dst)
    return dst


def test_unsupported_architecture_names_it(tiny, tmp_path):
    ck = _copy_ckpt(tiny, tmp_path)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["architectures"] = ["FancyNetForCausalLM"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match=r"FancyNetForCausalLM.*supported architectures"):
        prepare(PrepConfig(checkpoint=ck, out=tmp_path / "b", compile=False, device="cpu"))


def test_unsupported_dtype_and_rope(tiny, tmp_path):
    ck = _copy_ckpt(tiny, tmp_path)
    with pytest.raises(UnsupportedModel, match="dtype"):
        prepare(
            PrepConfig(checkpoint=ck, out=tmp_path / "b", dtype="int8", compile=False, device="cpu")
        )
    cfg = json.loads((ck / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModel, match="dynamic"):
        prepare(PrepConfig(checkpoint=ck, out=tmp_path / "b2", compile=False, device="cpu",
                           max_context_tokens=512, max_prefill_chunk_tokens=256))  # fmt: skip


def test_every_checkpoint_tensor_is_accounted_for(tiny, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    ck = _copy_ckpt(tiny, tmp_path, "llama")
    tensors = load_file(str(ck / "model.safetensors"))
    extra = dict(tensors, **{"model.extra_head.weight": torch.zeros(2, 2)})
    save_file(extra, str(ck / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match="no place in the model"):
        prepare(PrepConfig(checkpoint=ck, out=tmp_path / "b", compile=False, device="cpu",
                           max_context_tokens=512, max_prefill_chunk_tokens=256))  # fmt: skip
    missing = {k: v for k, v in tensors.items() if k != "model.norm.weight"}
    save_file(missing, str(ck / "model.safetensors"))
    with pytest.raises(UnsupportedModel, match=r"missing from the checkpoint"):
        prepare(PrepConfig(checkpoint=ck, out=tmp_path / "b", compile=False, device="cpu",
                           max_context_tokens=512, max_prefill_chunk_tokens=256))  # fmt: skip


def test_missing_files_fail_clearly(tmp_path):
    (tmp_path / "ck").mkdir()
    with pytest.raises(PrepError, match=r"config\.json"):
        prepare(PrepConfig(checkpoint=tmp_path / "ck", out=tmp_path / "b", compile=False))


def test_newer_bundle_format_is_refused_by_name(tiny, tmp_path):
    b = tmp_path / "bundle"
    shutil.copytree(tiny.bundle("qwen3"), b)
    m = json.loads((b / "manifest.json").read_text())
    m["format_version"] = 99
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="format version 99"):
        read_manifest(b)
    with pytest.raises(BundleError, match="not a Flare bundle"):
        read_manifest(tmp_path)


def test_prep_cli_exit_codes(tiny, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "prep", str(tiny.checkpoint("qwen3")), "--out", str(tmp_path / "b"),
         "--device", "cpu", "--max-context", "256", "--prefill-chunk", "128", "--no-compile"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert read_manifest(tmp_path / "b").catalog.max_context_tokens == 256
    bad = subprocess.run(
        [sys.executable, "-m", "prep", str(tiny.checkpoint("qwen3")), "--out", str(tmp_path / "c"),
         "--device", "cpu", "--prefill-chunk", "100", "--no-compile"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "multiple of 64" in bad.stderr


def test_prep_peak_memory_is_bounded(tiny, tmp_path):
    """Conversion streams tensor by tensor: the child's peak RSS growth stays far below two
    copies of a (synthetic, larger) checkpoint's weights."""
    from prep.tiny import make_tiny_checkpoint

    ck = make_tiny_checkpoint(tmp_path / "big", "llama",
                              config_overrides={"hidden_size": 512, "intermediate_size": 2048,
                                                "num_hidden_layers": 8, "num_attention_heads": 8,
                                                "num_key_value_heads": 4})  # fmt: skip
    weight_bytes = (ck / "model.safetensors").stat().st_size
    code = (
        "import resource, sys, torch, transformers; from pathlib import Path\n"
        "from prep.prepare import PrepConfig, prepare\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"prepare(PrepConfig(checkpoint=Path({str(ck)!r}), out=Path({str(tmp_path / 'bb')!r}), "
        "compile=False, device='cpu', max_context_tokens=512, max_prefill_chunk_tokens=256))\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth = int(out.stdout.strip().splitlines()[-1])
    assert growth < 1.2 * weight_bytes, (growth, weight_bytes)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="Linux /proc only")
def test_peak_rss_is_the_processs_own_not_its_parents():
    """A process started by a large parent: getrusage's ru_maxrss carries the parent's peak over
    the exec (a benchmark that built a 1.7B model in host memory made prep report 4.22 GiB for
    3.2 GiB of weights); prep.rss.peak_rss_bytes is the process's own high-water mark."""
    code = (
        "import resource, subprocess, sys\n"
        "x = bytearray(1 << 30)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "del x\n"
        "subprocess.run([sys.executable, '-c', 'import resource; from prep.rss import "
        "peak_rss_bytes; print(peak_rss_bytes(), "
        "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)'], check=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, inherited = map(int, out.stdout.split())
    assert inherited >= 1 << 30  # the kernel's ru_maxrss: the parent's gigabyte
    assert own < 256 << 20, own  # an interpreter that imported one small module


@pytest.mark.slow
def test_compile_cache_is_persisted_and_reused(tiny, tmp_path):
    """prep compiles into the bundle's cache; a runner in a fresh process hits it even though
    its KV page count differs from prep's. prep reports the warm-up process's own peak."""
    b = tmp_path / "compiled"
    prep_run = subprocess.run(
        [sys.executable, "-m", "prep", str(tiny.checkpoint("qwen3")), "--out", str(b),
         "--device", "cpu", "--max-context", "256", "--prefill-chunk", "128",
         "--decode-capacities", "1"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    warm_gib = float(prep_run.stdout.split("compile warm-up process ")[1].split()[0])
    assert 0.05 < warm_gib < 8, prep_run.stdout  # the child's report, read back
    m = read_manifest(b)
    assert m.compile.enabled and m.compile.mode == "decode-forward"
    assert any((b / "compile_cache").rglob("*"))
    code = (
        "from torch._dynamo.utils import counters\n"
        "from flared.runner.runner import ModelRunner, RunnerPlan\n"
        f"ModelRunner({str(b)!r}, RunnerPlan('cpu', 37, 2, compile='bundle', cuda_graphs=False))\n"
        "print(counters['inductor'].get('fxgraph_cache_hit', 0))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) >= 1
    # the cached code is keyed by Flare's ops and their tags: the runner's key equals prep's,
    # and a different one (as after an op's tags changed) misses instead of replaying old code
    stale = code.replace(
        "from flared.runner",
        "import prep.compiling as pc\npc.FlareOpsKey._uuid = 'flare-ops-other'\nfrom flared.runner",
    )
    out = subprocess.run([sys.executable, "-c", stale], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) == 0


def test_the_compile_cache_key_names_flare_ops_and_their_tags(tmp_path, monkeypatch):
    """configure() installs FlareOpsKey: its uuid digests every registered flare:: op with its
    tags (the layout tags change the compiled code but are not in the compile cache's key
    otherwise); a tag change changes it, the order the ops were registered in does not. On CPU
    it also sets Inductor's inlining limit to the GPU's (CPU_REALIZE_OPCOUNT)."""
    import importlib.util
    import os

    import torch

    from prep.compiling import (
        CPU_REALIZE_OPCOUNT,
        FlareOpsKey,
        configure,
        flare_ops,
        ops_fingerprint,
    )

    ops = flare_ops()
    names = {n for n, _ in ops}
    assert {"flare::write_kv", "flare::scatter_rows", "flare::cumsum_last"} <= names
    if importlib.util.find_spec("triton") is not None:  # the Triton ops, the decode MLP's too
        assert {"flare::skinny_linear", "flare::skinny_mlp"} <= names
    assert any("flexible_layout" in " ".join(tags) for _, tags in ops)
    assert ops_fingerprint(ops) == ops_fingerprint(list(reversed(ops)))
    untagged = [(n, [t for t in tags if "flexible" not in t]) for n, tags in ops]
    assert ops_fingerprint(untagged) != ops_fingerprint(ops)
    # an op's schema is in the key too: an argument added changes it
    assert all(any(t.startswith("schema=flare::") for t in tags) for _, tags in ops)
    grown = [(n, [t.replace(") ->", ", Tensor? more=None) ->") for t in tags]) for n, tags in ops]
    assert ops_fingerprint(grown) != ops_fingerprint(ops)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    dyn = torch._dynamo.config
    restore = {  # what configure() sets, restored on exit
        k: getattr(dyn, k)
        for k in ("recompile_limit", "automatic_dynamic_shapes",
                  "force_nn_module_property_static_shapes", "force_parameter_static_shapes")
    }  # fmt: skip
    ind = torch._inductor.config
    for device_type, opcount in (("cuda", None), ("cpu", CPU_REALIZE_OPCOUNT)):
        with ind.patch(post_grad_custom_pre_pass=None, realize_opcount_threshold=None), \
                dyn.patch(**restore):  # fmt: skip
            configure(tmp_path, device_type)
            key = torch._inductor.config.post_grad_custom_pre_pass
            assert isinstance(key, FlareOpsKey)
            assert key.uuid() == "flare-ops-" + ops_fingerprint(ops)
            # CPU executions inline as short expressions as GPU ones; CUDA keeps the default
            assert ind.realize_opcount_threshold == opcount


def test_a_failed_compile_warm_up_leaves_no_loadable_bundle(tiny, tmp_path):
    """The warm-up child failing for real (here its weights file is gone, as a kernel that does
    not compile on the device fails it there): PrepError names the warm-up and its exit, the
    manifest is removed so no daemon loads a bundle whose executions never ran."""
    from prep.bundle import MANIFEST_NAME
    from prep.prepare import warm_compile_cache

    b = tmp_path / "b"
    prepare(PrepConfig(checkpoint=tiny.checkpoint("qwen3"), out=b, compile=False, device="cpu",
                       max_context_tokens=256, max_prefill_chunk_tokens=128))  # fmt: skip
    weights = {t.file for t in read_manifest(b).tensors}
    for f in weights:
        (b / f).unlink()
    with pytest.raises(PrepError, match="compile warm-up on cpu exited with status 1") as exc:
        warm_compile_cache(b, "cpu")
    assert "without its manifest" in str(exc.value)
    assert not (b / MANIFEST_NAME).exists()
    with pytest.raises(BundleError, match="not a Flare bundle"):
        read_manifest(b)


def test_a_compiled_bundle_that_cannot_serve_its_cache_says_why(tiny, tmp_path, caplog):
    """cache_mismatch: a bundle compiled for another device kind runs uncompiled there, one
    compiled by another torch recompiles every execution at start; each is logged by the
    runner at start (here a CPU runner on a bundle whose manifest says CUDA: it runs eager)."""
    import logging

    import msgspec
    import torch

    from flared.runner.runner import ModelRunner, RunnerPlan
    from prep.bundle import CompileInfo, write_manifest
    from prep.compiling import cache_mismatch

    info = CompileInfo(enabled=True, cache_dir="compile_cache", torch_version="2.11.0",
                       device_kind="cuda")  # fmt: skip
    assert cache_mismatch(info, "cuda", "2.11.0") is None
    assert "on cpu its executions run uncompiled" in cache_mismatch(info, "cpu", "2.11.0")
    assert "torch 2.11.0 and this is torch 2.13.0" in cache_mismatch(info, "cuda", "2.13.0")
    assert cache_mismatch(msgspec.structs.replace(info, enabled=False), "cpu", "2.13.0") is None
    b = tmp_path / "b"
    shutil.copytree(tiny.bundle("qwen3"), b)
    m = read_manifest(b)
    write_manifest(b, msgspec.structs.replace(
        m, compile=msgspec.structs.replace(m.compile, enabled=True, device_kind="cuda",
                                           torch_version=str(torch.__version__))))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="flared.runner"):
        r = ModelRunner(str(b), RunnerPlan("cpu", 37, 2, compile="bundle", cuda_graphs=False))
    assert r.compile_mode == "none"
    assert any("compiled for cuda; on cpu" in rec.getMessage() for rec in caplog.records)
