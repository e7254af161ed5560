"""Checkpoint sources: tensor headers, single-tensor reads and name routing.

Tensors are read with plain file reads into a buffer of their own: unlike a memory map, nothing
of a checkpoint file stays resident in this process beyond the tensor being converted (the
page cache is the kernel's), so prep's reported peak memory is what conversion holds.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from prep.errors import PrepError, UnsupportedModel
from prep.recipes.checkpoints import SourceLayout, Stacked

K = TypeVar("K")
_READ_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


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


@dataclass(frozen=True)
class Unloaded:
    """A checkpoint tensor deliberately left out of the bundle."""

    source: SourceTensor
    reason: str


@dataclass(frozen=True)
class SlicePiece:
    source: SourceTensor
    index: int
    part: str
    rule: Stacked


@dataclass
class Routes:
    """Where each source tensor goes, by model (execution-layout) name."""

    whole: dict[str, SourceTensor] = field(default_factory=dict)
    pieces: dict[str, list[SlicePiece]] = field(default_factory=dict)
    unloaded: list[Unloaded] = field(default_factory=list)


def route_sources(
    sources: list[SourceTensor],
    layout: SourceLayout,
    wanted: dict[str, torch.Tensor],
    ignore: list[str],
) -> Routes:
    """Apply the layout to every source name: skipped, stored whole, a slice of a stacked
    parameter, ignored by the Transformers model class, or unexpected (raised, all at once)."""
    routes = Routes()
    unexpected: list[str] = []
    stacks = [(re.compile(s.pattern), s) for s in layout.stacked]
    for src in sources:
        reason = layout.skip_reason(src.name)
        name = layout.rename(src.name) if reason is None else src.name
        reason = reason or layout.skip_reason(name)
        if reason is not None:
            routes.unloaded.append(Unloaded(src, reason))
            continue
        if name in wanted:
            if name in routes.whole:
                raise UnsupportedModel(
                    f"{routes.whole[name].name} and {src.name} both map to {name}"
                )
            routes.whole[name] = src
            continue
        piece = _match_stack(src, name, stacks, wanted)
        ignored = next((p for p in ignore if re.search(p, name)), None)
        if piece is not None:
            routes.pieces.setdefault(piece[0], []).append(piece[1])
        elif ignored is not None:
            reason = f"ignored by the Transformers model class (pattern {ignored!r})"
            routes.unloaded.append(Unloaded(src, reason))
        else:
            unexpected.append(src.name)
    if unexpected:
        raise UnsupportedModel(
            f"{len(unexpected)} checkpoint tensors have no place in the model, e.g. "
            f"{unexpected[:5]}"
        )
    return routes


def _match_stack(
    src: SourceTensor,
    name: str,
    stacks: list[tuple[re.Pattern[str], Stacked]],
    wanted: dict[str, torch.Tensor],
) -> tuple[str, SlicePiece] | None:
    for pattern, rule in stacks:
        m = pattern.search(name)
        if m is None or m.group("part") not in rule.parts:
            continue
        target = f"{m.group('stack')}.{rule.parts[m.group('part')].param}"
        if target in wanted:
            return target, SlicePiece(src, int(m.group("index")), m.group("part"), rule)
    return None


class SafetensorsReader:
    """One checkpoint file, read a tensor at a time (header parsed once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("rb")
        size = int.from_bytes(self._fh.read(8), "little")
        self._header: dict[str, Any] = json.loads(self._fh.read(size))
        self._data_start = 8 + size

    def read(self, name: str) -> torch.Tensor:
        entry = self._header[name]
        begin, end = entry["data_offsets"]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        view = buf.numpy().data  # writable memoryview over the tensor's storage
        self._fh.seek(self._data_start + begin)
        got = 0
        while got < len(view):
            n = self._fh.readinto(view[got:])
            if not n:
                raise PrepError(f"{self.path}: truncated while reading tensor {name!r}")
            got += n
        return buf.view(_READ_DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def close(self) -> None:
        self._fh.close()


def read_in_order(
    items: list[tuple[K, SourceTensor]],
) -> Iterator[tuple[K, SourceTensor, torch.Tensor]]:
    """(key, source) -> (key, source, tensor), one tensor alive at a time; callers group items
    by file so that each file is opened once."""
    reader: SafetensorsReader | None = None
    try:
        for key, src in items:
            if reader is None or reader.path != src.file:
                if reader is not None:
                    reader.close()
                reader = SafetensorsReader(src.file)
            yield key, src, reader.read(src.name)
    finally:
        if reader is not None:
            reader.close()
