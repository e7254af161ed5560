"""A prepared call: one static-shaped execution over static input buffers.

On CUDA it is warmed up and captured once as a CUDA graph (all graphs share one memory pool and
run on the model stream); afterwards `run()` only replays. On CPU the same (optionally
compiled) callable runs over the same static buffers.

Inputs live as views of one packed device buffer per call, mirrored by packed host staging
buffers, so a staged call uploads with one copy. Host staging: `num_staging` pinned host copies
used round-robin, each guarded by the event of the step that last read it, so two steps can be
in flight without the host overwriting an input that a queued copy has not read yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

_ALIGN = 256  # byte alignment of each input inside the packed buffer
# input dtypes staged through numpy views (every input of the catalog's calls)
_NUMPY_DTYPES = (torch.int64, torch.int32, torch.float32, torch.bool, torch.uint8)


def _layout(inputs: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
    """Byte offset of each input in one packed buffer, and the buffer's size."""
    offsets: dict[str, int] = {}
    end = 0
    for name, t in inputs.items():
        start = -(-end // _ALIGN) * _ALIGN
        offsets[name] = start
        end = start + t.numel() * t.element_size()
    return offsets, max(end, 1)


def _views(
    blob: torch.Tensor, like: dict[str, torch.Tensor], offsets: dict[str, int]
) -> dict[str, torch.Tensor]:
    return {
        name: blob[offsets[name] : offsets[name] + t.numel() * t.element_size()]
        .view(t.dtype)
        .view(t.shape)
        for name, t in like.items()
    }


class PreparedCall:
    def __init__(
        self,
        name: str,
        fn: Callable[[], None],
        inputs: dict[str, torch.Tensor],
        device: torch.device,
        num_staging: int = 2,
    ) -> None:
        """`inputs` is the dict `fn` reads its inputs from at call time; its tensors are moved
        here into views of one packed device buffer (initial values kept), so that one copy
        uploads a whole staged call."""
        self.name = name
        self.fn = fn
        self.device = device
        self.cuda = device.type == "cuda"
        self.graph: Any = None
        offsets, size = _layout(inputs)
        self._offsets = offsets
        # bytes per index of each input's first dimension (for `offset`, on the step path)
        self._row_bytes = {
            name: t.element_size() * (t[0].numel() if t.dim() else 1) for name, t in inputs.items()
        }
        self._blob = torch.zeros(size, dtype=torch.uint8, device=device)
        packed = _views(self._blob, inputs, offsets)
        for key, view in packed.items():
            view.copy_(inputs[key])
        inputs.update(packed)  # fn looks its inputs up in this same dict
        self.inputs = inputs
        self._staging_blobs: list[torch.Tensor] = []
        self._staging: list[dict[str, torch.Tensor]] = []
        # numpy views of the same staging buffers: an element store through numpy costs a
        # fraction of a torch indexing call (which dispatches an operator per store)
        self._staging_arrays: list[dict[str, np.ndarray]] = []
        # per staging set: the event its last upload recorded (created by the first upload,
        # then re-recorded), None before any upload
        self._staging_events: list[Any] = []
        for _ in range(num_staging if self.cuda else 1):
            # staging starts as a copy of the inputs' initial values (e.g. all-ones masks); a
            # copy on CPU too, so that uploads there move exactly what they move on CUDA
            host = self._blob.to("cpu", copy=True)
            host = host.pin_memory() if self.cuda else host
            self._staging_blobs.append(host)
            views = _views(host, inputs, offsets)
            self._staging.append(views)
            self._staging_arrays.append(
                {name: t.numpy() for name, t in views.items() if t.dtype in _NUMPY_DTYPES}
            )
            self._staging_events.append(None)
        self._next = 0

    def stage(self) -> dict[str, torch.Tensor]:
        """The host buffers to fill for the next run (waits until they are free to overwrite)."""
        return self._staging[self._free_staging()]

    def stage_arrays(self) -> dict[str, np.ndarray]:
        """`stage()` as numpy arrays over the same host memory."""
        return self._staging_arrays[self._free_staging()]

    def _free_staging(self) -> int:
        i = self._next
        ev = self._staging_events[i]
        if ev is not None:
            ev.synchronize()
        return i

    def offset(self, name: str, index: int = 0) -> int:
        """Byte offset of element `index` (along the first dimension) of input `name` in the
        packed buffer: what `upload(upto=...)` must cover for inputs[name][:index]."""
        return self._offsets[name] + index * self._row_bytes[name]

    def upload(self, stream: Any = None, upto: int | None = None) -> None:
        """Copy the staged host buffers into the static device inputs: one stream-ordered copy
        of the packed buffer, or of its first `upto` bytes (the caller knows that the device
        already holds the rest as staged; inputs are packed in their dict order)."""
        i = self._next
        if upto is None or upto >= self._blob.shape[0]:
            self._blob.copy_(self._staging_blobs[i], non_blocking=self.cuda)
        else:
            self._blob[:upto].copy_(self._staging_blobs[i][:upto], non_blocking=self.cuda)
        if self.cuda:
            ev = self._staging_events[i]
            if ev is None:
                ev = self._staging_events[i] = torch.cuda.Event()
            ev.record(stream)
        self._next = (i + 1) % len(self._staging)

    def run(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()

    def capture(self, pool: Any, stream: Any, warmup: int = 2) -> None:
        """Warm up on a side stream and capture one CUDA graph into the shared pool."""
        side = torch.cuda.Stream()
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.fn()
        stream.wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.fn()
        torch.cuda.synchronize()
        self.graph = graph
