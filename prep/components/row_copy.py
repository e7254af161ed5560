"""Copy whole rows of many tensors in one launch: checkpoint snapshots and restores.

A snapshot of a hybrid row copies one row of every state tensor (recurrent matrices and
convolution histories of every linear-attention layer); a tail-page copy copies one page of
every attention layer's K and V storage. Copied tensor by tensor, that is tens of small kernels
per checkpoint and the copy is launch-bound (measured 39 GB/s for a 19.5 MB hybrid row on the
H200). Here one kernel copies the rows of every tensor as 32-bit words through a table of base
addresses, so a copy is one launch whatever the layer count.

Table (built once over tensors that live as long as the table; captured graphs replay it):

    ptrs    [N] int64   base address of tensor i
    words   [N] int64   32-bit words per row of tensor i (its row bytes / 4)
    stride  [N] int64   words between consecutive rows of tensor i

`scatter_rows_into` (one launch instead of four: gather, compare, select, index_copy) writes
values[i] into row rows[i] of one pool tensor, skipping the null row; the state pool's
`scatter_rows` op runs it on CUDA (`RowScatter`).

Call: pairs src [P], dst [P] of row indices; a pair is skipped where dst == skip or src == dst
(padding). Real destinations are distinct and never a source of the same call. Grid
(N, ceil(max words / BLOCK)), each program walking the pairs (padding pairs cost one index
load, not a program); programs past a tensor's row length exit at once. Bit-exact: words are
moved, never converted.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger("prep.row_copy")
BLOCK_WORDS = 4096  # 16 KiB per program and pair


@triton.jit
def _copy_rows_kernel(PTRS, WORDS, STRIDE, SRC, DST, skip, num_pairs, BLOCK: tl.constexpr):
    # program (t, b): words [b * BLOCK, (b + 1) * BLOCK) of tensor t, for every pair in turn
    t = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    n = tl.load(WORDS + t)
    if start < n:
        base = tl.load(PTRS + t).to(tl.pointer_type(tl.int32))
        stride = tl.load(STRIDE + t)
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        for p in range(0, num_pairs):
            src = tl.load(SRC + p)
            dst = tl.load(DST + p)
            if (dst != skip) & (src != dst):
                x = tl.load(base + src * stride + offs, mask=mask)
                tl.store(base + dst * stride + offs, x, mask=mask)


SCATTER_BLOCK = 2048  # elements per program


@triton.jit
def _scatter_rows_kernel(POOL, VALUES, ROWS, row_numel, s_pool, s_val, null, BLOCK: tl.constexpr):
    # program (b, c): elements [c * BLOCK, (c + 1) * BLOCK) of values[b] -> pool[rows[b]]
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(ROWS + b)
    if row != null:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_numel
        x = tl.load(VALUES + b * s_val + offs, mask=mask)
        tl.store(POOL + row * s_pool + offs, x, mask=mask)


def scatter_rows_into(
    pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, null: int
) -> None:
    """pool[rows[i]] = values[i] (in pool's dtype) where rows[i] != null: elements are
    moved, never converted by the kernel.

    pool [N, ...] contiguous; values [B, *pool.shape[1:]]; rows [B] int64, real entries
    distinct. Rows named `null` are not touched at all."""
    b = rows.shape[0]
    n = pool[0].numel() if pool.shape[0] else 0
    if b == 0 or n == 0:
        return
    if values.dtype != pool.dtype:  # converted as torch rounds (the serving paths never need it)
        values = values.to(pool.dtype)
    vals = values.reshape(b, n)  # a view for row-contiguous values
    rows = rows.contiguous()  # (as the compiler stored it: contiguous in practice)
    grid = (b, triton.cdiv(n, SCATTER_BLOCK))
    _scatter_rows_kernel[grid](
        pool, vals, rows, n, pool.stride(0), vals.stride(0), null, BLOCK=SCATTER_BLOCK,
        num_warps=4,
    )  # fmt: skip


class RowScatter:
    """`scatter_rows_into` where it can run (CUDA, contiguous pool, matching shapes); says
    once, and for good, when its kernel cannot run here. As with RowCopier, the first call
    happens while the runner warms its executions, before any graph capture."""

    def __init__(self) -> None:
        self._failed = False

    def scatter(
        self, pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, null: int
    ) -> bool:
        if (
            self._failed
            or not pool.is_cuda
            or not pool.is_contiguous()
            or values.shape != (rows.shape[0], *pool.shape[1:])
        ):
            return False
        try:
            scatter_rows_into(pool, rows, values, null)
        except Exception:  # compile or launch failure: the indexing path stays correct
            log.exception("one-launch row scatter unavailable; scattering with indexing ops")
            self._failed = True
            return False
        return True


class RowTable:
    """The address table over `tensors` ([rows, ...] each, rows contiguous, row bytes a
    multiple of 4). Holds references so the addresses stay valid."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a row table needs at least one tensor")
        device = tensors[0].device
        words, strides = [], []
        for t in tensors:
            row_bytes = t[0].nbytes
            step = t.stride(0) * t.element_size()
            if not t[0].is_contiguous() or row_bytes % 4 or step % 4 or t.device != device:
                raise ValueError(f"rows of a {tuple(t.shape)} {t.dtype} tensor cannot be copied")
            words.append(row_bytes // 4)
            strides.append(step // 4)
        self.tensors = list(tensors)
        self.ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
        self.words = torch.tensor(words, dtype=torch.int64, device=device)
        self.stride = torch.tensor(strides, dtype=torch.int64, device=device)
        self.max_words = max(words)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, skip: int) -> None:
        """Row src[i] -> row dst[i] of every tensor (see the module docstring)."""
        grid = (len(self.tensors), triton.cdiv(self.max_words, BLOCK_WORDS))
        _copy_rows_kernel[grid](
            self.ptrs, self.words, self.stride, src, dst, skip, src.shape[0],
            BLOCK=BLOCK_WORDS, num_warps=8,
        )  # fmt: skip


class RowCopier:
    """A lazily built RowTable that says once, and for good, when it cannot run here.

    The first copy happens while the runner warms its executions, before any graph capture,
    so a kernel that fails to compile on this device is found there; the caller then keeps
    its per-tensor path."""

    def __init__(self) -> None:
        self._table: RowTable | None = None
        self._failed = False

    def copy(
        self, tensors: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, skip: int
    ) -> bool:
        if self._failed or not tensors or not tensors[0].is_cuda:
            return False
        try:
            if self._table is None:
                self._table = RowTable(tensors)
            self._table.copy(src, dst, skip)
        except Exception:  # compile or launch failure: the per-tensor path stays correct
            log.exception("one-launch row copy unavailable; copying tensor by tensor")
            self._failed = True
            return False
        return True


__all__ = ["BLOCK_WORDS", "RowCopier", "RowScatter", "RowTable", "scatter_rows_into"]
