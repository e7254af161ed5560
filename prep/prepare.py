"""`flare prep`: checkpoint directory -> bundle directory.

Order: validate config and architecture (recipe), account for every checkpoint tensor on a meta
model, validate the catalog, stream weights into the execution layout, copy frontend assets,
write the manifest, then (unless --no-compile) warm every prepared execution once on the target
device with the bundle's Inductor cache directory so the daemon's load hits a warm cache.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prep import recipes
from prep.bundle import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    Catalog,
    CompileInfo,
    Frontend,
    Layout,
    Manifest,
    TensorEntry,
    write_manifest,
)
from prep.compiling import COMPILE_CACHE_DIR, FORWARD_MODES, compile_cache_env
from prep.errors import InvalidCapacity, PrepError, UnsupportedModel
from prep.model import DTYPES, build_meta_model, load_config
from prep.sources import scan_checkpoint
from prep.weights import fingerprint, plan_tensors, source_account, write_execution_weights

FLARE_VERSION = "0.1.0"
WEIGHTS_FILE = "weights/model.safetensors"
DEFAULT_MAX_CONTEXT = 32768


@dataclass(frozen=True)
class PrepConfig:
    checkpoint: Path
    out: Path
    device: str = "auto"
    dtype: str = "auto"
    max_context_tokens: int | None = None  # None: the model's limit, at most DEFAULT_MAX_CONTEXT
    max_prefill_chunk_tokens: int = 512
    decode_capacities: tuple[int, ...] = (1, 2, 4, 8)
    # prefill capacities added to the powers of two (e.g. 384, 768: an appended agent turn of
    # ~350 tokens then pads to 384, not 512); multiples of 64 up to the chunk limit. Steps
    # finer than 128 buy nothing on the H200: GEMM row tiles are 128, so 320 tokens cost what
    # 384 cost (Qwen3.5-9B shape: 192/256/320/384 -> 9.9/9.9/12.5/13.0 ms; 2B: 320 5.27, 384 5.09)
    extra_prefill_capacities: tuple[int, ...] = ()
    page_size: int = 16
    compile: bool = True
    # "auto": regional on CUDA (decode compiled whole with its sampling, as decode-sampling,
    # which measured fastest for decode on the H200; prefill through per-layer compiled
    # decoder layers), decode-forward on CPU
    compile_mode: str = "auto"  # "auto" or a key of prep.compiling.FORWARD_MODES
    fused_layout: bool = True  # the recipe's execution layout; False keeps the canonical one
    max_top_logprobs: int = 20


def prefill_capacities(chunk_limit: int) -> list[int]:
    """Powers of two from 128 below the chunk limit, plus the limit itself."""
    caps = []
    c = 128
    while c < chunk_limit:
        caps.append(c)
        c *= 2
    caps.append(chunk_limit)
    return caps


def validate_catalog(cfg: PrepConfig, model_max_positions: int | None) -> Catalog:
    ctx = cfg.max_context_tokens
    if ctx is None:
        ctx = min(model_max_positions or DEFAULT_MAX_CONTEXT, DEFAULT_MAX_CONTEXT)
    chunk, ps = cfg.max_prefill_chunk_tokens, cfg.page_size
    if ps < 1 or ps & (ps - 1):
        raise InvalidCapacity(f"page size {ps} must be a power of two")
    if ctx < ps or ctx % ps:
        raise InvalidCapacity(
            f"context limit {ctx} must be a positive multiple of the page size {ps}"
        )
    if model_max_positions is not None and ctx > model_max_positions:
        raise InvalidCapacity(
            f"context limit {ctx} exceeds the model's max_position_embeddings {model_max_positions}"
        )
    if chunk < 64 or chunk % 64 or chunk > ctx:
        raise InvalidCapacity(
            f"prefill chunk {chunk} must be a multiple of 64 between 64 and the context limit {ctx}"
        )
    caps = sorted(set(cfg.decode_capacities))
    if not caps or caps[0] < 1 or caps[-1] > 256:
        raise InvalidCapacity(f"decode capacities {list(cfg.decode_capacities)} must lie in 1..256")
    prefill = [chunk] if chunk < 128 else prefill_capacities(chunk)
    for c in cfg.extra_prefill_capacities:
        if c < 64 or c % 64 or c > chunk:
            raise InvalidCapacity(
                f"prefill capacity {c} must be a multiple of 64 between 64 and the chunk limit {chunk}"
            )
    prefill = sorted({*prefill, *cfg.extra_prefill_capacities})
    return Catalog(
        decode_capacities=caps,
        prefill_capacities=prefill,
        max_prefill_chunk_tokens=chunk,
        max_context_tokens=ctx,
        max_top_logprobs=cfg.max_top_logprobs,
    )


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PrepError("--device cuda requested but no CUDA device is available")
    if device not in ("cpu", "cuda"):
        raise PrepError(f"unsupported device {device!r} (choose auto, cpu or cuda)")
    return device


def _resolve_dtype(dtype: str, config: Any, device: str) -> str:
    if dtype == "auto":
        src = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "")
        src = src.replace("torch.", "")
        if device == "cpu":
            return "float32"
        return src if src in ("bfloat16", "float16") else "bfloat16"
    if dtype not in DTYPES:
        raise UnsupportedModel(f"dtype {dtype!r} is not supported (choose {sorted(DTYPES)})")
    return dtype


def _eos_ids(ckpt: Path, config: Any) -> list[int]:
    ids: list[int] = []
    eos = getattr(config, "eos_token_id", None)
    for v in eos if isinstance(eos, list) else [eos]:
        if isinstance(v, int):
            ids.append(v)
    tc = ckpt / "tokenizer_config.json"
    if tc.is_file():
        tok_eos = json.loads(tc.read_text()).get("eos_token")
        if isinstance(tok_eos, dict):
            tok_eos = tok_eos.get("content")
        if isinstance(tok_eos, str) and (ckpt / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            tid = Tokenizer.from_file(str(ckpt / "tokenizer.json")).token_to_id(tok_eos)
            if tid is not None and tid not in ids:
                ids.append(int(tid))
    if not ids:
        raise UnsupportedModel("the checkpoint declares no EOS token id (config or tokenizer)")
    return ids


def _drop_unreachable_window(config: Any, window: int | None, catalog: Catalog) -> bool:
    """A sliding window at least the bundle's context limit never hides a key (a query at
    position p < limit <= window sees every key, as without one), yet a declared window keeps
    the attention off the paged kernels (CUDA runs the reference attention for windows). Such
    a window is switched off in `config`, which the bundle then carries (Mistral-7B-v0.1's
    4,096 window, served at 4,096 tokens or fewer, is full attention). True when it was."""
    if window is None or window < catalog.max_context_tokens:
        return False
    config.sliding_window = None
    if getattr(config, "layer_types", None):
        config.layer_types = ["full_attention"] * len(config.layer_types)
    if hasattr(config, "use_sliding_window"):
        config.use_sliding_window = False
    return True


def prepare(cfg: PrepConfig, stats: dict[str, int] | None = None) -> Manifest:
    """Write the bundle; `stats`, where given, receives `warm_peak_rss_bytes` (the compile
    warm-up process's own peak resident memory) when the bundle is compiled."""
    ckpt = cfg.checkpoint
    if not (ckpt / "config.json").is_file():
        raise PrepError(f"{ckpt}: config.json not found (expected a Transformers checkpoint)")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (ckpt / f).is_file():
            raise PrepError(f"{ckpt}: {f} not found (a fast tokenizer is required)")
    read = recipes.read_checkpoint(load_config(ckpt))
    config = read.config  # the model prepared (a wrapper's language model)
    recipe = recipes.resolve(config)
    recipe.validate(config)
    device = _resolve_device(cfg.device)
    dtype_name = _resolve_dtype(cfg.dtype, config, device)
    catalog = validate_catalog(cfg, getattr(config, "max_position_embeddings", None))
    compile_mode = cfg.compile_mode
    if compile_mode == "auto":
        compile_mode = "regional" if device == "cuda" else "decode-forward"
    if compile_mode not in FORWARD_MODES or compile_mode == "none":
        raise PrepError(
            f"unknown compile mode {cfg.compile_mode!r} "
            f"(choose auto or one of {', '.join(m for m in FORWARD_MODES if m != 'none')})"
        )
    geometry = recipe.geometry(config, cfg.page_size)
    window_dropped = _drop_unreachable_window(config, geometry.sliding_window, catalog)
    if window_dropped:
        geometry = recipe.geometry(config, cfg.page_size)

    sources = scan_checkpoint(ckpt)
    layout = recipe.layout(config) if cfg.fused_layout else Layout()
    meta = build_meta_model(config, layout)
    tplan = plan_tensors(meta, sources, read.layout)
    del meta

    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontend").mkdir(exist_ok=True)
    weight_bytes = write_execution_weights(tplan, DTYPES[dtype_name], out / WEIGHTS_FILE)
    config_json = (ckpt / "config.json").read_bytes()
    if read.wrapper is None and not window_dropped:
        shutil.copyfile(ckpt / "config.json", out / "config.json")
    else:  # the language model's config, as its text-only checkpoint would carry it
        config.to_json_file(str(out / "config.json"), use_diff=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ckpt / f, out / "frontend" / f)
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    template = tok_cfg.get("chat_template")
    if template is None and (ckpt / "chat_template.jinja").is_file():
        template = (ckpt / "chat_template.jinja").read_text()
    reasoning, tools = recipe.parsers(config)
    frontend = Frontend(
        tokenizer_file="frontend/tokenizer.json",
        tokenizer_config_file="frontend/tokenizer_config.json",
        chat_template=template if isinstance(template, str) else None,
        eos_token_ids=_eos_ids(ckpt, config),
        reasoning_parser=reasoning,
        tool_parser=tools,
    )
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        flare_version=FLARE_VERSION,
        created_utc=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        architecture=config.architectures[0],
        model_type=config.model_type,
        dtype=dtype_name,
        kv_dtype=dtype_name,
        checkpoint_fingerprint=fingerprint(config_json, sources),
        geometry=geometry,
        catalog=catalog,
        sampling_defaults=recipe.sampling_defaults(config),
        frontend=frontend,
        tensors=[
            TensorEntry(name=n, dtype=dtype_name, shape=list(s.shape), file=WEIGHTS_FILE)
            for n, s in sorted(tplan.stored.items())
        ],
        tied_parameters=tplan.tied_groups,
        compile=CompileInfo(
            enabled=cfg.compile,
            cache_dir=COMPILE_CACHE_DIR,
            torch_version=str(torch.__version__),
            device_kind=device,
            mode=compile_mode if cfg.compile else "none",
        ),
        weight_bytes=weight_bytes,
        layout=layout,
        source=source_account(read.source_architecture, sources, tplan),
    )
    write_manifest(out, manifest)
    if cfg.compile:
        peak = warm_compile_cache(out, device)
        if stats is not None:
            stats["warm_peak_rss_bytes"] = peak
    return manifest


def warm_compile_cache(bundle: Path, device: str) -> int:
    """Run every prepared execution once, compiled, so the Inductor cache holds them all;
    returns the warm-up process's peak resident memory in bytes (its own, prep.rss).

    This runs in a child process (`python -m prep.warm`), because the Inductor cache directory
    is read from the environment when torch initialises. Where it fails (a kernel that does not
    compile for this device, memory), the bundle's manifest is removed, so no daemon loads a
    bundle whose executions were never run, and PrepError says so (the child's own error is
    printed above it).
    """
    import subprocess
    import sys

    env = {**os.environ, **compile_cache_env(bundle)}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "peak_rss_bytes"
        rc = subprocess.run(
            [sys.executable, "-m", "prep.warm", str(bundle), device, str(report)], env=env
        ).returncode
        if rc != 0:
            (bundle / MANIFEST_NAME).unlink(missing_ok=True)
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
            raise PrepError(
                f"the compile warm-up on {device} {how} (its error is above); {bundle} is left "
                "without its manifest, so nothing serves it: fix the cause and prep again "
                "(--no-compile prepares without compiling)"
            )
        return int(report.read_text())
