"""The recurrent-state pool: per-row state of linear-attention layers, addressed by row index.

Region map (first dimension of every pool tensor, R live rows, S snapshot rows):

    row 0                 NULL_ROW: the null (initial) state; padding reads it, nothing writes it
    rows 1 .. R           live rows; live row r holds the state of request row r
    rows R+1 .. R+S       snapshot rows: immutable copies of a live row at an exact consumed count

Every tensor the recipe declares (`prep.bundle.StateTensor`: FP32 recurrent matrices, causal
convolution histories, ...) is one [R+S+1, *shape] tensor. Beside them the pool keeps, per row,
the consumed count the state corresponds to and the final hidden vector of the last consumed
token (meaningful for snapshot rows; a restore writes both back into the request state).

All writes go through `scatter_rows`, which skips NULL_ROW entries exactly: a padded index
leaves every pool tensor bit-identical. Shared code reads the declared layout only; it never
knows which model the tensors belong to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from prep.bundle import StateTensor
from prep.components import SHARED_STEP_INPUTS

NULL_ROW = 0
_DTYPES = {"float32": torch.float32, "int64": torch.int64}


@torch.library.custom_op("flare::scatter_rows", mutates_args=("pool",), tags=SHARED_STEP_INPUTS)
def scatter_rows(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """pool[rows[i]] = values[i] for every rows[i] != NULL_ROW; pool: [N, ...], values [B, ...].

    Opaque and in place on purpose (as `flare::write_kv`): traced as index_copy_ on a graph
    input, the compiler would functionalise it into a copy of the whole pool per layer per step.
    Padding entries leave row 0 exactly as it was, whatever their count; real entries must be
    distinct. On CUDA one Triton launch skips them (`row_copy.scatter_rows_into`); elsewhere
    padding entries rewrite row 0 with its own value.
    """
    if pool.is_cuda and _row_scatter().scatter(pool, rows, values, NULL_ROW):
        return  # one launch (row_copy.scatter_rows_into), the same result
    keep = pool.index_select(0, rows)
    write = (rows != NULL_ROW).view(-1, *([1] * (pool.dim() - 1)))
    pool.index_copy_(0, rows, torch.where(write, values.to(pool.dtype), keep))


_SCATTER: Any = None


def _row_scatter() -> Any:
    """row_copy.RowScatter, imported on first CUDA use (it needs Triton)."""
    global _SCATTER
    if _SCATTER is None:
        from prep.components.row_copy import RowScatter

        _SCATTER = RowScatter()
    return _SCATTER


@scatter_rows.register_fake
def _(pool, rows, values):  # type: ignore[no-untyped-def]
    return None


@dataclass
class StatePool:
    specs: list[StateTensor]
    tensors: list[torch.Tensor]  # per spec: [R+S+1, *shape]
    consumed: torch.Tensor  # [R+S+1] int64
    hidden: torch.Tensor  # [R+S+1, H] execution dtype
    num_live_rows: int
    num_snapshot_rows: int
    # CUDA: one-launch row copies over every declared tensor (prep.components.row_copy)
    _rows: Any = field(default=None, init=False, repr=False)

    @staticmethod
    def allocate(
        specs: list[StateTensor],
        num_live_rows: int,
        num_snapshot_rows: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StatePool:
        rows = num_live_rows + num_snapshot_rows + 1
        tensors = [
            torch.full((rows, *s.shape), s.fill, dtype=_DTYPES.get(s.dtype, dtype), device=device)
            for s in specs
        ]
        return StatePool(
            specs=list(specs),
            tensors=tensors,
            consumed=torch.zeros(rows, dtype=torch.int64, device=device),
            hidden=torch.zeros(rows, hidden_size, dtype=dtype, device=device),
            num_live_rows=num_live_rows,
            num_snapshot_rows=num_snapshot_rows,
        )

    @property
    def num_rows(self) -> int:
        return self.consumed.shape[0]

    @property
    def first_snapshot_row(self) -> int:
        return self.num_live_rows + 1

    def layer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        return {s.name: t for s, t in zip(self.specs, self.tensors) if s.layer == layer}

    def bind_layers(self, layers: Any) -> None:
        """Hand each declaring decoder layer its pool tensors: the layer's prepared module with
        a `bind_state(tensors)` method receives them (see PreparedGatedDeltaNet)."""
        for idx in sorted({s.layer for s in self.specs}):
            bound = [m for m in layers[idx].modules() if hasattr(m, "bind_state")]
            if len(bound) != 1:
                raise ValueError(f"decoder layer {idx} declares state but has {len(bound)} owners")
            bound[0].bind_state(self.layer_tensors(idx))

    def row_bytes(self) -> int:
        """Bytes of one row over every declared tensor (the memory planner's unit)."""
        return sum(t[0].nbytes for t in self.tensors) + self.hidden[0].nbytes + 8

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + self.hidden.nbytes + self.consumed.nbytes

    # -- maintenance (static shapes: row-index buffers with NULL_ROW padding) ----------------
    def fill_rows(self, dst: torch.Tensor) -> None:
        """Initialise rows dst [N]: every declared tensor to its fill value, consumed to 0."""
        for spec, t in zip(self.specs, self.tensors):
            values = torch.full(
                (dst.shape[0], *t.shape[1:]), spec.fill, dtype=t.dtype, device=t.device
            )
            scatter_rows(t, dst, values)
        scatter_rows(self.consumed, dst, torch.zeros_like(dst))
        scatter_rows(self.hidden, dst, torch.zeros_like(self.hidden.index_select(0, dst)))

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the declared tensors of rows src [N] into rows dst [N] (dst NULL_ROW: skipped).

        Sources and destinations of one call must be disjoint."""
        if self.tensors and self.tensors[0].is_cuda:  # one launch over every tensor
            if self._rows is None:
                from prep.components.row_copy import RowCopier

                self._rows = RowCopier()
            if self._rows.copy(self.tensors, src, dst, skip=NULL_ROW):
                return
        for t in self.tensors:
            scatter_rows(t, dst, t.index_select(0, src))

    def check_integrity(self) -> None:
        """The null row holds the initial state and a zero count."""
        for spec, t in zip(self.specs, self.tensors):
            if not bool((t[NULL_ROW] == spec.fill).all()):
                raise AssertionError(f"null row of {spec.layer}/{spec.name} was written")
        if int(self.consumed[NULL_ROW]) != 0 or bool(self.hidden[NULL_ROW].any()):
            raise AssertionError("null row metadata was written")
