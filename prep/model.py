"""Build the canonical Transformers model with prepared attention and load bundle weights.

Used by preparation (on the meta device, for tensor accounting) and by `flared` at load time
(on the serving device). The model is constructed once, without random initialisation, and
every stored tensor is copied straight into its parameter: no second full copy exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from prep.bundle import Layout
from prep.components import paged_attention
from prep.components.fused import weight_targets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(directory: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))


def build_model(
    config: Any, device: torch.device | str, dtype: torch.dtype, layout: Layout | None = None
) -> torch.nn.Module:
    """The canonical CausalLM with the paged-attention implementation and the recipe's module
    surgery for `layout` (None: the canonical layout), weights uninitialised."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    paged_attention.register()
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=paged_attention.ATTN_IMPLEMENTATION
        )
        _apply_layout(model, config, layout)
    model.tie_weights()  # no_init_weights skips the tying that post-init would do
    model.eval()
    model.requires_grad_(False)
    return model


def build_meta_model(config: Any, layout: Layout | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    paged_attention.register()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=paged_attention.ATTN_IMPLEMENTATION
        )
        _apply_layout(model, config, layout)
    return model


def _apply_layout(model: torch.nn.Module, config: Any, layout: Layout | None) -> None:
    from prep import recipes

    recipes.prepare_state_modules(model)  # recurrent layers over the state pool, if any
    if layout is None or layout == Layout():
        return
    recipes.resolve(config).prepare_modules(model, layout)


# safetensors dtype names -> torch dtypes (the ones a bundle can hold)
_ST_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
STAGING_BYTES = 64 << 20  # per pinned staging buffer of a load onto CUDA (two)


def safetensors_index(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]:
    """name -> (dtype, shape, absolute byte offset, byte length) of each tensor of a
    safetensors file, from its header alone; raises ValueError on a malformed header."""
    import json

    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file")
        n = int.from_bytes(head, "little")
        size = path.stat().st_size
        if n > size - 8:
            raise ValueError(f"{path}: header length {n} exceeds the file")
        header = json.loads(fh.read(n))
    out: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(x) for x in info["shape"])
        count = 1
        for d in shape:
            count *= d
        if not 0 <= start <= end or end - start != count * dtype.itemsize or 8 + n + end > size:
            raise ValueError(f"{path}: tensor {name!r} has inconsistent byte offsets")
        out[name] = (dtype, shape, 8 + n + start, end - start)
    return out


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from the file at `offset` (short reads continue; EOF raises)."""
    import os

    done = 0
    while done < len(buf):
        got = os.preadv(fd, [buf[done:]], offset + done)
        if got <= 0:
            raise ValueError("weights file ended early")
        done += got


class _Reader:
    """Reads tensors from an open file straight into their destinations with positional reads:
    no mapping of the file, so the process never holds the file's pages on top of the
    weights (a mapped file's touched pages count in its resident memory, and on unified-memory
    machines compete with the accelerator's copy). A host destination of the file's dtype is
    read into in place; a CUDA destination goes through two pinned staging buffers, one
    filling while the other's copy runs."""

    def __init__(self) -> None:
        self.staging: list[torch.Tensor] = []
        self.events: list[Any] = []
        self.next = 0

    def read(self, fd: int, offset: int, nbytes: int, dst: torch.Tensor) -> None:
        flat = dst.view(-1).view(torch.uint8) if dst.is_contiguous() else None
        if flat is None or flat.numel() != nbytes:
            raise ValueError("destination is not a contiguous tensor of the stored bytes")
        if dst.device.type == "cpu":
            _pread_into(fd, memoryview(flat.numpy()), offset)
            return
        if dst.device.type != "cuda":
            raise ValueError(f"weights cannot be loaded onto {dst.device}")
        if not self.staging:
            self.staging = [
                torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in "ab"
            ]
            self.events = [None, None]
        for at in range(0, nbytes, self.staging[0].numel()):
            i = self.next
            self.next = 1 - i
            if self.events[i] is not None:
                self.events[i].synchronize()  # its previous copy has read the buffer
            n = min(self.staging[i].numel(), nbytes - at)
            buf = self.staging[i][:n]
            _pread_into(fd, memoryview(buf.numpy()), offset + at)
            flat[at : at + n].copy_(buf, non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record()

    def finish(self) -> None:
        for ev in self.events:
            if ev is not None:
                ev.synchronize()


def load_weights(model: torch.nn.Module, files: list[Path]) -> int:
    """Copy every stored tensor into its parameter; returns bytes copied. Raises on any gap.

    Tensors are read with positional reads into their parameters (see `_Reader`). A stored
    tensor whose dtype or layout differs from its destination is read whole and converted."""
    import os

    targets = weight_targets(model)
    filled: set[int] = set()
    total = 0
    reader = _Reader()
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                for name, (dtype, shape, offset, nbytes) in safetensors_index(Path(f)).items():
                    if name not in targets:
                        raise KeyError(f"bundle tensor {name!r} has no place in the model")
                    dst = targets[name]
                    if tuple(dst.shape) != shape:
                        raise ValueError(
                            f"bundle tensor {name!r} has shape {list(shape)}, its place "
                            f"{list(dst.shape)}"
                        )
                    with torch.no_grad():
                        if dst.dtype == dtype and dst.is_contiguous():
                            reader.read(fd, offset, nbytes, dst)
                        else:
                            t = torch.empty(shape, dtype=dtype)
                            reader.read(fd, offset, nbytes, t)
                            dst.copy_(t)
                    filled.add(id(dst))
                    total += nbytes
            finally:
                os.close(fd)
    finally:
        reader.finish()  # no staging buffer is reused or freed under a running copy
    missing = [n for n, t in targets.items() if id(t) not in filled]
    if missing:
        raise KeyError(f"bundle is missing weights for {missing[:5]}")
    return total
