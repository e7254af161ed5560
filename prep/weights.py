"""Checkpoint scanning, tensor accounting and streaming conversion to the execution layout.

Conversion holds at most one tensor at a time: the output safetensors file is written header
first, then tensor by tensor, so preparation never materialises a second full copy.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prep.errors import PrepError, UnsupportedModel

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
SUPPORTED_SOURCE_DTYPES = {"F32", "BF16", "F16"}


@dataclass(frozen=True)
class SourceTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path


def scan_checkpoint(ckpt: Path) -> list[SourceTensor]:
    """Headers of every tensor in every *.safetensors file of the checkpoint directory."""
    from safetensors import safe_open

    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise PrepError(f"{ckpt}: no *.safetensors files (other weight formats are not supported)")
    out: list[SourceTensor] = []
    seen: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name in seen:
                    raise PrepError(f"tensor {name!r} appears in more than one checkpoint file")
                seen.add(name)
                sl = fh.get_slice(name)
                out.append(SourceTensor(name, sl.get_dtype(), tuple(sl.get_shape()), f))
    return out


def fingerprint(config_json: bytes, tensors: list[SourceTensor]) -> str:
    h = hashlib.sha256(config_json)
    for t in sorted(tensors, key=lambda t: t.name):
        h.update(f"{t.name}|{t.dtype}|{t.shape}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class TensorPlan:
    """Which source tensor fills which parameter; tied groups share one stored tensor."""

    stored: dict[str, SourceTensor]  # execution-layout name -> source
    tied_groups: list[list[str]]


def plan_tensors(meta_model: torch.nn.Module, sources: list[SourceTensor]) -> TensorPlan:
    """Account for every checkpoint tensor and every model parameter, or raise."""
    from prep.components.fused import weight_targets

    wanted = weight_targets(meta_model)
    ignore = [
        re.compile(p) for p in getattr(meta_model, "_keys_to_ignore_on_load_unexpected", None) or []
    ]
    by_name = {t.name: t for t in sources}
    unexpected = [n for n in by_name if n not in wanted and not any(p.search(n) for p in ignore)]
    if unexpected:
        raise UnsupportedModel(
            f"{len(unexpected)} checkpoint tensors have no place in the model, e.g. "
            f"{unexpected[:5]}"
        )
    groups: dict[int, list[str]] = {}
    for name, t in wanted.items():
        groups.setdefault(id(t), []).append(name)
    stored: dict[str, SourceTensor] = {}
    tied: list[list[str]] = []
    for names in groups.values():
        present = [n for n in names if n in by_name]
        if not present:
            raise UnsupportedModel(f"model tensor(s) {names} are missing from the checkpoint")
        src = by_name[present[0]]
        shape = tuple(wanted[names[0]].shape)
        if src.shape != shape:
            raise UnsupportedModel(f"tensor {src.name}: checkpoint shape {src.shape} != {shape}")
        if src.dtype not in SUPPORTED_SOURCE_DTYPES:
            raise UnsupportedModel(
                f"tensor {src.name}: dtype {src.dtype} is not supported "
                f"(supported: {sorted(SUPPORTED_SOURCE_DTYPES)}; quantized checkpoints need a "
                "quantization recipe)"
            )
        stored[names[0]] = src
        if len(names) > 1:
            tied.append(sorted(names))
    return TensorPlan(stored=stored, tied_groups=tied)


def _file_order(plan: TensorPlan) -> list[str]:
    """Names grouped by source file, so conversion reads each file once and buffers nothing."""
    by_file: dict[Path, list[str]] = {}
    for name, src in plan.stored.items():
        by_file.setdefault(src.file, []).append(name)
    return [n for names in by_file.values() for n in names]


def _iter_converted(
    plan: TensorPlan, order: list[str], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    handle: Any = None
    current: Path | None = None
    try:
        for name in order:
            src = plan.stored[name]
            if src.file != current:
                if handle is not None:
                    handle.__exit__(None, None, None)
                handle = safe_open(str(src.file), framework="pt").__enter__()
                current = src.file
            t = handle.get_tensor(src.name)
            if t.is_floating_point():
                t = t.to(dtype)
            yield name, t.contiguous()
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)


def write_execution_weights(plan: TensorPlan, dtype: torch.dtype, out_file: Path) -> int:
    """Stream every planned tensor into one safetensors file; returns the payload bytes.

    The header is computed from source headers alone; then each tensor is read, converted,
    written and dropped before the next, so peak memory is one tensor beyond the page cache.
    """
    entries: dict[str, Any] = {}
    offset = 0
    order = _file_order(plan)
    elem = torch.empty((), dtype=dtype).element_size()
    for name in order:
        src = plan.stored[name]
        nbytes = _numel(src.shape) * elem
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(src.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    entries["__metadata__"] = {"format": "pt", "producer": "flare-prep"}
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out_file.open("wb") as fh:
        fh.write(len(header).to_bytes(8, "little"))
        fh.write(header)
        for name, tensor in _iter_converted(plan, order, dtype):
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != entries[name]["data_offsets"][1] - entries[name]["data_offsets"][0]:
                raise PrepError(f"internal error: tensor {name} changed size during conversion")
            fh.write(data.tobytes())
            written += data.nbytes
            del tensor, data
    if written != offset:
        raise PrepError("internal error: not every tensor was written")
    return offset


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
