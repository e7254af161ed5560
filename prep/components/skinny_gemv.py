"""Decode products as a register GEMV: y[M, N] = x[M, K] @ W[N, K]^T for M <= 16 rows, with
the weight tile loaded straight into registers and the dot products on the CUDA cores.

Why a second form beside `skinny_gemm`'s: that kernel feeds tl.dot through a shared-memory
software pipeline, and a product with few output rows (the o and down projections, N <= 4,096)
gives each SM one 16- or 32-row tile whose stream is a few pipeline depths long; read from L2
the 1.7B's o still takes 4.7 µs against a 1.0 µs empty launch (H100). Here a program issues
every load of a K-chunk at once (one vectorised tl.load of BLOCK_N x BLOCK_K weights, 32-64 KiB
per program), so the whole weight can be in flight across the SMs after one round trip; the
next chunk's loads are issued before the current one is used (a register double buffer).

Arithmetic: each row is a separate pass over the weight tile held in registers (fp32 products
summed over the chunk, then chunk after chunk in order, then split after split in order:
`skinny_gemm.split_partials_sum`), so row m's result never depends on M nor on the other rows:
the batch invariance `skinny_gemm` keeps. Its cost grows with M (M passes of CUDA-core FMAs),
so it is meant for the narrow products at small decode batches. The forms (`GemvConfig.form`)
differ in how a pass gets its x row and reduces: `cores` loads it from L2, `xl1` first asks L1
for every row's lines of the chunk at once (the same bits), `seg` also reduces only within
256-column segments and sums the segments once for all rows at the end; `dot` is one tl.dot of
the rows (padded to 16) with the chunk from registers (MMA: cost independent of M, per-element
sums independent of the other rows, the tile kernel's property). The folded layers' variants
(1/rms of each row, SiLU(gate) * up over interleaved rows, the residual add) are the tile
kernel's epilogue after the same passes (`skinny_gemm.tile_epilogue`). `benchmarks/skinny_gemm.py
--gemv` measures them against the tile kernel (H100:
`benchmarks/results/2026-12-06-h100-skinny-gemv.jsonl`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prep.components import launch
from prep.components.skinny_gemm import (
    CACHE_LINE_BYTES,
    MAX_ROWS,
    rows_sumsq,
    split_buffers,
    split_tile_sum,
    tile_epilogue,
    tile_offsets,
)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows per program
    block_k: int  # columns per chunk (one load per chunk)
    num_warps: int
    split_k: int = 1  # programs per N-tile, each over its own run of chunks
    # "cores": a CUDA-core pass per row, each loading its x row; "xl1": the same passes after
    # one request for every row's lines of the chunk into L1 (a pass's load then waits on L1,
    # not on a round trip to L2); "seg": xl1 with each pass reducing within 256-column
    # segments only, the segments summed once for all rows at the end; "dot": one tl.dot of
    # the rows (padded to 16) with the chunk from registers (MMA, cost independent of M)
    form: str = "cores"

    def label(self) -> str:
        tag = "" if self.form == "cores" else self.form
        base = f"gemv{tag}{self.block_n}x{self.block_k}w{self.num_warps}"
        return base if self.split_k == 1 else f"{base}k{self.split_k}"


FORMS = {"cores": 0, "dot": 1, "xl1": 2, "seg": 3}  # GemvConfig.form -> the kernel's FORM
SEG_COLUMNS = 256  # the seg form's segment: one warp's 32 x 8 columns


GEMV_MAX_N = 8192  # wider products (gate|up, the vocabulary head) keep the tile kernel
GEMV_MAX_K = 8192  # deeper ones too (the Qwen3-8B's down: 37.2 against the tiles' 36.2 µs)
GEMV_FORM = "cores"  # the measured form (H100, 2026-12-06-h100-skinny-gemv.jsonl)


def gemv_config(n: int, k: int) -> GemvConfig | None:
    """The configuration `decode_gemm = "gemv"` runs an [n, k] product with, by shape alone (so a
    row's result never depends on the batch beside it), or None for the tile kernel: 8-row tiles
    of 2,048-column chunks, 8 warps, K unsplit, for at most GEMV_MAX_N output rows and
    GEMV_MAX_K columns: the fastest configuration at one row for the Qwen3-1.7B shape's q|k|v, o
    and down and the Qwen3-8B shape's o (H100: 7.80 / 5.18 / 10.46 / 13.18 µs against the tile
    kernel's 8.36 / 6.19 / 13.14 / 14.39); at four rows the `cores` form is slower than the
    tiles (o 7.18 against 6.36 µs)."""
    if n > GEMV_MAX_N or k > GEMV_MAX_K:
        return None
    return GemvConfig(8, min(2048, triton.next_power_of_2(k)), 8, 1, GEMV_FORM)


def gemv_plan(k: int, cfg: GemvConfig) -> tuple[int, int]:
    """(programs per N-tile, chunks each): `cfg.split_k` runs of whole chunks, fewer where K
    has fewer chunks than that (no program without columns)."""
    chunks = -(-k // cfg.block_k)
    per = -(-chunks // max(1, cfg.split_k))
    return -(-chunks // per), per


@triton.jit
def _prefetch_rows_l1(X, M, K, s_xm, kk, offs_m, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """Ask L1 for every row's lines of the chunk at once (rows past M ask for row M - 1's
    again: no new bytes), so the per-row loads after it do not each wait a round trip to L2."""
    rows = tl.minimum(offs_m, M - 1)
    cols = tl.minimum(tl.min(kk, axis=0) + tl.arange(0, BLOCK_K // LINE) * LINE, K - 1)
    tl.inline_asm_elementwise(
        "prefetch.global.L1 [$1]; mov.u32 $0, 0;", "=r,l",
        [X + rows[:, None] * s_xm + cols[None, :]], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _rows_pass(
    acc, w, X, M, K, s_xm, kk, k_ok, offs_m,
    FORM: tl.constexpr, PRECISION: tl.constexpr, L1_PREFETCH: tl.constexpr,
    BLOCK_K: tl.constexpr, LINE: tl.constexpr, SEG: tl.constexpr,
):  # fmt: skip
    """acc += the chunk's products for each of the M rows. FORM 0 (cores): a CUDA-core pass
    per row, each loading its x row and reducing over the whole chunk; 2 (xl1): the same after
    `_prefetch_rows_l1`; 3 (seg): the same prefetch, then each row's pass reduces only within
    SEG-column segments (acc [BLOCK_M, BLOCK_N, BLOCK_K // SEG]; the segments are summed once,
    for every row, after the last chunk: fewer cross-warp steps per row); 1 (dot): one tl.dot
    of all rows with the chunk. L1_PREFETCH: off where the prefetch cannot run (the
    interpreter); the arithmetic is the same either way."""
    if FORM == 1:
        xt = tl.load(X + offs_m[:, None] * s_xm + kk[None, :],
                     mask=(offs_m < M)[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(xt, tl.trans(w), acc, input_precision=PRECISION)
    else:
        if FORM >= 2 and L1_PREFETCH:
            _prefetch_rows_l1(X, M, K, s_xm, kk, offs_m, BLOCK_K, LINE)
        if FORM == 3:
            w3 = tl.reshape(w, (w.shape[0], BLOCK_K // SEG, SEG))
            for m in range(0, M):
                xr = tl.load(X + m * s_xm + kk, mask=k_ok, other=0.0)
                x3 = tl.reshape(xr, (BLOCK_K // SEG, SEG)).to(tl.float32)
                part = tl.sum(w3.to(tl.float32) * x3[None, :, :], axis=2)
                acc += tl.where(offs_m[:, None, None] == m, part[None, :, :], 0.0)
        else:
            for m in range(0, M):
                xr = tl.load(X + m * s_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
                part = tl.sum(w.to(tl.float32) * xr[None, :], axis=1)
                acc += tl.where(offs_m[:, None] == m, part[None, :], 0.0)
    return acc


@triton.jit
def _gemv_kernel(
    X, W, Y, M, N, s_xm, s_wn, s_ym, P, CNT, R, s_rm, eps,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CHUNKS: tl.constexpr, SPLIT_K: tl.constexpr, WIDE_W: tl.constexpr,
    FORM: tl.constexpr = 0, DOT_PRECISION: tl.constexpr = None,
    L1_PREFETCH: tl.constexpr = False, LINE: tl.constexpr = 64, SEG: tl.constexpr = 256,
    PROLOGUE: tl.constexpr = 0, RESIDUAL: tl.constexpr = False,
    SILU_PAIRS: tl.constexpr = False, PDL: tl.constexpr = 0,
):  # fmt: skip
    """Program (t, s): rows t * BLOCK_N.. of W, chunks s * CHUNKS.. of BLOCK_K columns. With
    SPLIT_K > 1 the fp32 partials meet in P [SPLIT_K, N-tiles, BLOCK_M, BLOCK_N] and the last
    of a tile's programs sums them in split order (a counter per tile in CNT). The folded
    layers' epilogues are the tile kernel's (`skinny_gemm.tile_epilogue`): PROLOGUE 3 (the tile
    kernel's folded RMSNorm; 0: none), 1/rms of each x row (its sum of squares from a pass over x while the first chunk's weights are in
    flight) times the products; SILU_PAIRS, SiLU(gate) * up over interleaved rows (Y has N / 2
    columns); RESIDUAL, + R.

    PDL (launched with programmatic dependent launch, SM90; 0 off, else where the program lets
    the next PDL launch be scheduled: 1 first, 2 after its wait, 3 after its chunks; launch.py):
    the first chunk's weight loads go out before the wait for the previous grid (weights are
    never written during a step), straight into the registers the first pass reads, and
    everything a previous kernel may write (x, the residual, the split partials and counters)
    is read after it: the weight stream starts while the previous kernel drains."""
    tile, offs_m, offs_n, offs_k, m_ok, n_ok, w_rows = tile_offsets(
        M, N, BLOCK_M, BLOCK_N, BLOCK_K, WIDE_W
    )
    k_lo = tl.program_id(1) * (CHUNKS * BLOCK_K)
    if FORM == 3:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // SEG), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kk = k_lo + offs_k
    k_ok = kk < K
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(W + w_rows[:, None] * s_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)  # fmt: skip
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 3:  # x is a few KB and L2-resident; SEG-wide blocks keep registers for w
        sumsq = rows_sumsq(X, s_xm, offs_m, m_ok, K, BLOCK_M, SEG)
    for c in tl.static_range(CHUNKS):
        if c + 1 < CHUNKS:  # the next chunk's loads go out before this one is used
            kn = k_lo + (c + 1) * BLOCK_K + offs_k
            kn_ok = kn < K
            w_next = tl.load(W + w_rows[:, None] * s_wn + kn[None, :],
                             mask=n_ok[:, None] & kn_ok[None, :], other=0.0)  # fmt: skip
            acc = _rows_pass(acc, w, X, M, K, s_xm, kk, k_ok, offs_m, FORM, DOT_PRECISION,
                             L1_PREFETCH, BLOCK_K, LINE, SEG)  # fmt: skip
            w, kk, k_ok = w_next, kn, kn_ok
        else:
            acc = _rows_pass(acc, w, X, M, K, s_xm, kk, k_ok, offs_m, FORM, DOT_PRECISION,
                             L1_PREFETCH, BLOCK_K, LINE, SEG)  # fmt: skip
    if FORM == 3:  # the segments' sums, for every row at once
        acc = tl.sum(acc, axis=2)
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT_K == 1:
        tile_epilogue(acc, sumsq, Y, R, tile, offs_m, offs_n, m_ok, n_ok, N, s_ym, s_rm, eps,
                      K, BLOCK_M, BLOCK_N, PROLOGUE, RESIDUAL, SILU_PAIRS)  # fmt: skip
    else:
        last, total = split_tile_sum(P, CNT, acc, offs_m, m_ok, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            tile_epilogue(total, sumsq, Y, R, tile, offs_m, offs_n, m_ok, n_ok, N, s_ym, s_rm,
                          eps, K, BLOCK_M, BLOCK_N, PROLOGUE, RESIDUAL, SILU_PAIRS)  # fmt: skip


def gemv_into(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    cfg: GemvConfig,
    *,
    eps: float = 0.0,
    folded_norm: bool = False,
    silu_pairs: bool = False,
    residual: torch.Tensor | None = None,
    pdl: bool | None = None,
    pdl_trigger: str | None = None,
) -> None:
    """y = x @ w^T by `_gemv_kernel`: x [M, K] (M <= 16), w [N, K], y [M, N], unit stride
    along K and N. The folded layers' variants, as `skinny_gemm.skinny_matmul_into` takes
    them: `folded_norm`, RMSNorm(x) with its weight folded into w (eps applies);
    `silu_pairs`, w's rows interleave gate and up and y [M, N / 2] = SiLU(gate) * up;
    `residual` [M, N] added. `pdl`: launch with programmatic dependent launch (None: as
    `launch.set_pdl` chose; only ever on SM90 and newer), triggering the next launch at
    `pdl_trigger` (None: the process-wide choice)."""
    m = x.shape[0]
    n, k = w.shape
    if m > MAX_ROWS:
        raise ValueError(f"the GEMV takes at most {MAX_ROWS} rows, got {m}")
    cols = n // 2 if silu_pairs else n
    if x.shape[1] != k or y.shape != (m, cols):
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} for a [{n}, {k}] weight")
    if silu_pairs and (residual is not None or n % 2 or cfg.block_n % 2):
        raise ValueError("silu_pairs: an even N and block_n, no residual")
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError("the residual must have the output's shape, unit stride along N")
    if x.stride(1) != 1 or w.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("the GEMV needs unit stride along K and N")
    if cfg.form not in FORMS:
        raise ValueError(f"unknown GEMV form {cfg.form!r} (choose {', '.join(FORMS)})")
    if any(v < 1 or v & (v - 1) for v in (cfg.block_n, cfg.block_k)):
        raise ValueError(f"{cfg.label()}: block_n and block_k must be powers of two")
    if cfg.form == "dot" and (cfg.block_n < 16 or cfg.block_k < 16):
        raise ValueError(f"{cfg.label()}: tl.dot needs at least 16 weight rows and columns")
    tiles = triton.cdiv(n, cfg.block_n)
    splits, chunks = gemv_plan(k, cfg)
    partials, counters = split_buffers(y, splits, tiles, cfg.block_n)
    r = residual if residual is not None else y  # unread without the residual
    mode = launch.pdl_mode(x.device, pdl, pdl_trigger)
    _gemv_kernel[(tiles, splits)](
        x, w, y, m, n, x.stride(0), w.stride(0), y.stride(0), partials, counters,
        r, r.stride(0), eps,
        K=k, BLOCK_M=MAX_ROWS, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, CHUNKS=chunks,
        SPLIT_K=splits, WIDE_W=n * w.stride(0) >= 2**31,
        FORM=FORMS[cfg.form], DOT_PRECISION=launch.dot_precision(w.dtype),
        L1_PREFETCH=x.is_cuda, LINE=min(cfg.block_k, CACHE_LINE_BYTES // x.element_size()),
        SEG=min(SEG_COLUMNS, cfg.block_k), PROLOGUE=3 if folded_norm else 0,
        RESIDUAL=residual is not None, SILU_PAIRS=silu_pairs, PDL=mode,
        num_warps=cfg.num_warps, num_stages=1, launch_pdl=mode > 0,
    )  # fmt: skip
