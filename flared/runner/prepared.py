"""A prepared call: one static-shaped execution over static input buffers.

On CUDA it is warmed up and captured once as a CUDA graph (all graphs share one memory pool and
run on the model stream); afterwards `run()` only replays. On CPU the same (optionally
compiled) callable runs over the same static buffers.

Host staging: every input has `num_staging` pinned host copies used round-robin, each guarded by
the event of the step that last read it, so two steps can be in flight without the host
overwriting an input that a queued copy has not read yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class PreparedCall:
    def __init__(
        self,
        name: str,
        fn: Callable[[], None],
        inputs: dict[str, torch.Tensor],
        device: torch.device,
        num_staging: int = 2,
    ) -> None:
        self.name = name
        self.fn = fn
        self.inputs = inputs
        self.device = device
        self.cuda = device.type == "cuda"
        self.graph: Any = None
        self._staging: list[dict[str, torch.Tensor]] = []
        self._staging_events: list[Any] = []
        for _ in range(num_staging if self.cuda else 1):
            # staging starts as a copy of the inputs' initial values (e.g. all-ones masks)
            self._staging.append(
                {k: v.detach().to("cpu").clone().pin_memory() if self.cuda else v.detach().clone()
                 for k, v in inputs.items()}
            )  # fmt: skip
            self._staging_events.append(None)
        self._next = 0

    def stage(self) -> dict[str, torch.Tensor]:
        """The host buffers to fill for the next run (waits until they are free to overwrite)."""
        i = self._next
        ev = self._staging_events[i]
        if ev is not None:
            ev.synchronize()
        return self._staging[i]

    def upload(self, stream: Any = None) -> None:
        """Copy the staged host buffers into the static device inputs (stream-ordered)."""
        i = self._next
        for k, dst in self.inputs.items():
            dst.copy_(self._staging[i][k], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(stream)
            self._staging_events[i] = ev
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
