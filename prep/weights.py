"""Tensor accounting and streaming conversion to the execution layout.

Conversion holds at most one source tensor at a time: the output safetensors file is written
header first, then each source tensor at its offset (a per-expert tensor into its slice of the
stacked parameter), so preparation never materialises a second full copy. Reading and name
routing live in `prep.sources`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prep.bundle import NotLoaded, SourceAccount
from prep.errors import PrepError, UnsupportedModel
from prep.recipes.checkpoints import SourceLayout
from prep.sources import (
    SlicePiece,
    SourceTensor,
    Unloaded,
    read_in_order,
    route_sources,
)

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
_SOURCE_ELEMENT_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2}


def fingerprint(config_json: bytes, tensors: list[SourceTensor]) -> str:
    h = hashlib.sha256(config_json)
    for t in sorted(tensors, key=lambda t: t.name):
        h.update(f"{t.name}|{t.dtype}|{t.shape}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Piece:
    """One source tensor, written at element `offset` of a stored tensor (a contiguous block)."""

    source: SourceTensor
    offset: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the bundle: one whole source tensor, or per-index pieces (e.g. experts)
    that tile it exactly once."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    stacked: bool = False  # pieces are per-index slices (else one whole source tensor)


@dataclass(frozen=True)
class TensorPlan:
    """Which source tensors fill which stored tensor; tied groups share one stored tensor.

    Invariant: every source tensor is exactly one piece of one stored tensor or one Unloaded."""

    stored: dict[str, StoredTensor]  # execution-layout name -> its pieces
    tied_groups: list[list[str]]
    not_loaded: list[Unloaded] = field(default_factory=list)


def plan_tensors(
    meta_model: torch.nn.Module, sources: list[SourceTensor], layout: SourceLayout | None = None
) -> TensorPlan:
    """Account for every checkpoint tensor and every model parameter, or raise."""
    from prep.components.fused import weight_targets

    wanted = weight_targets(meta_model)
    ignore = list(getattr(meta_model, "_keys_to_ignore_on_load_unexpected", None) or [])
    routes = route_sources(sources, layout or SourceLayout(), wanted, ignore)
    groups: dict[int, list[str]] = {}
    for name, t in wanted.items():
        groups.setdefault(id(t), []).append(name)
    stored: dict[str, StoredTensor] = {}
    tied: list[list[str]] = []
    not_loaded = list(routes.unloaded)
    for names in groups.values():
        whole = [n for n in names if n in routes.whole]
        pieces = [n for n in names if n in routes.pieces]
        if whole and pieces:
            raise UnsupportedModel(
                f"{whole[0]} is in the checkpoint both whole and as per-index tensors "
                f"(e.g. {routes.pieces[pieces[0]][0].source.name})"
            )
        if whole:
            src = routes.whole[whole[0]]
            stored[names[0]] = StoredTensor(_check_whole(src, wanted[names[0]]), (Piece(src, 0),))
            not_loaded += [
                Unloaded(routes.whole[n], f"tied to {whole[0]}: stored once") for n in whole[1:]
            ]
        elif pieces:
            stored[names[0]] = _stack(pieces[0], wanted[names[0]], routes.pieces[pieces[0]])
        else:
            raise UnsupportedModel(f"model tensor(s) {names} are missing from the checkpoint")
        if len(names) > 1:
            tied.append(sorted(names))
    return TensorPlan(stored=stored, tied_groups=tied, not_loaded=not_loaded)


def _check_whole(src: SourceTensor, target: torch.Tensor) -> tuple[int, ...]:
    shape = tuple(target.shape)
    if src.shape != shape:
        raise UnsupportedModel(f"tensor {src.name}: checkpoint shape {src.shape} != {shape}")
    _check_dtype(src)
    return shape


def _check_dtype(src: SourceTensor) -> None:
    if src.dtype not in SUPPORTED_SOURCE_DTYPES:
        raise UnsupportedModel(
            f"tensor {src.name}: dtype {src.dtype} is not supported "
            f"(supported: {sorted(SUPPORTED_SOURCE_DTYPES)}; quantized checkpoints need a "
            "quantization recipe)"
        )


def _stack(name: str, target: torch.Tensor, slices: list[SlicePiece]) -> StoredTensor:
    """The stored tensor `name` assembled from per-index pieces, each checked against its slice
    of the (meta) parameter; raises naming every missing or surplus index."""
    if not target.is_contiguous():
        raise UnsupportedModel(f"{name}: a stacked parameter must be contiguous")
    count, rule = int(target.shape[0]), slices[0].rule
    extra = sorted({p.source.name for p in slices if p.index >= count})
    if extra:
        raise UnsupportedModel(
            f"{name}: the checkpoint has {rule.unit}s beyond the {count} the config declares, "
            f"e.g. {extra[:3]}"
        )
    seen: dict[tuple[int, str], SourceTensor] = {}
    out: list[Piece] = []
    for p in slices:
        if (p.index, p.part) in seen:
            raise UnsupportedModel(
                f"{p.source.name} and {seen[p.index, p.part].name} fill the same slice"
            )
        seen[p.index, p.part] = p.source
        spec = rule.parts[p.part]
        view = target[p.index]  # [rows, ...]: one index; a part is rows chunk/chunks of it
        rows = int(view.shape[0]) // spec.chunks
        view = view.narrow(0, spec.chunk * rows, rows)
        if p.source.shape != tuple(view.shape):
            raise UnsupportedModel(
                f"tensor {p.source.name}: checkpoint shape {p.source.shape} != "
                f"{tuple(view.shape)}, its slice of {name}"
            )
        _check_dtype(p.source)
        out.append(Piece(p.source, int(view.storage_offset() - target.storage_offset())))
    param = name.rpartition(".")[2]
    missing = [
        f"{part} of {rule.unit}s {idx}"
        for part, spec in rule.parts.items()
        if spec.param == param and (idx := [i for i in range(count) if (i, part) not in seen])
    ]
    if missing:
        raise UnsupportedModel(
            f"{name}: the checkpoint is missing {'; '.join(missing)} "
            f"(the config declares {count} {rule.unit}s)"
        )
    return StoredTensor(tuple(target.shape), tuple(sorted(out, key=lambda q: q.offset)), True)


def source_account(
    architecture: str, sources: list[SourceTensor], plan: TensorPlan
) -> SourceAccount:
    """The manifest's record of how every source tensor was used; checks the plan's invariant."""
    pieces = [p for st in plan.stored.values() for p in st.pieces]
    stacked = sum(len(st.pieces) for st in plan.stored.values() if st.stacked)
    by_reason: dict[str, list[SourceTensor]] = {}
    for u in plan.not_loaded:
        by_reason.setdefault(u.reason, []).append(u.source)
    used = [p.source.name for p in pieces] + [u.source.name for u in plan.not_loaded]
    if sorted(used) != sorted(t.name for t in sources):
        raise PrepError("internal error: the tensor plan does not account for every source tensor")
    return SourceAccount(
        architecture=architecture,
        num_tensors=len(sources),
        num_stored=len(pieces) - stacked,
        num_stacked=stacked,
        not_loaded=[
            NotLoaded(reason, sorted(t.name for t in ts), sum(_source_bytes(t) for t in ts))
            for reason, ts in sorted(by_reason.items())
        ],
    )


def _source_bytes(t: SourceTensor) -> int:
    return _numel(t.shape) * _SOURCE_ELEMENT_BYTES.get(t.dtype, 1)


def _write_order(plan: TensorPlan) -> list[tuple[tuple[str, int], SourceTensor]]:
    """((stored name, element offset), source) for every piece, grouped by source file so that
    conversion opens each file once."""
    by_file: dict[Path, list[tuple[tuple[str, int], SourceTensor]]] = {}
    for name, st in plan.stored.items():
        for piece in st.pieces:
            by_file.setdefault(piece.source.file, []).append(((name, piece.offset), piece.source))
    return [item for items in by_file.values() for item in items]


def write_execution_weights(plan: TensorPlan, dtype: torch.dtype, out_file: Path) -> int:
    """Stream every planned tensor into one safetensors file; returns the payload bytes.

    The header is computed from source headers alone, tensors in name order (the bundle does
    not depend on how the checkpoint was sharded). Then each source tensor is read, converted,
    written at its offset (a stacked tensor's pieces land in their slices) and dropped before
    the next, so peak memory is one source tensor and its converted copy.
    """
    entries: dict[str, Any] = {}
    offset = 0
    elem = torch.empty((), dtype=dtype).element_size()
    for name in sorted(plan.stored):
        shape = plan.stored[name].shape
        nbytes = _numel(shape) * elem
        entries[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    entries["__metadata__"] = {"format": "pt", "producer": "flare-prep"}
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    data_start = 8 + len(header)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with out_file.open("wb") as fh:
        fh.write(len(header).to_bytes(8, "little"))
        fh.write(header)
        for (name, at), src, tensor in read_in_order(_write_order(plan)):
            if tensor.is_floating_point():
                tensor = tensor.to(dtype)
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != _numel(src.shape) * elem:
                raise PrepError(f"internal error: tensor {name} changed size during conversion")
            fh.seek(data_start + entries[name]["data_offsets"][0] + at * elem)
            fh.write(data.data)  # the array's buffer: no bytes copy
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
