"""Skinny GEMM for decode: y[M, N] = x[M, K] @ W[N, K]^T with M <= 16 rows.

Why not cuBLAS: at decode the batch is 1-8 tokens and every projection is a pure weight stream.
cuBLAS picks a different kernel per M (so a row's result depends on how many rows run beside it)
and, measured on the H200 at M=1, streams the weights at well under the copy bandwidth for the
projection shapes of small models.

Layout: W stays in nn.Linear's row-major [N, K] layout, so a program reads whole contiguous
K-runs of BLOCK_N weight rows. Grid: (ceil(N / BLOCK_N),). The M rows are padded to 16 for
tl.dot; the padding costs no memory traffic (the weights dominate by 3 orders of magnitude).

Batch invariance: the tile configuration depends only on (N, K), never on M, and each output
element is one dot product over K in a fixed order, so row m's result is bitwise the same
whatever the other rows hold. A test pins this.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from prep.components import launch

MAX_ROWS = 16


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs per N-tile, each over its own K range (see _skinny_kernel)

    def label(self) -> str:
        base = f"{self.block_n}x{self.block_k}w{self.num_warps}s{self.num_stages}"
        return base if self.split_k == 1 else f"{base}k{self.split_k}"


def tile_config(n: int, k: int) -> TileConfig:
    """A configuration by shape alone (never by M: see batch invariance above), from sweeps of
    every projection on the H200 (benchmarks/skinny_gemm.py --sweep; Qwen3-1.7B in
    2026-12-02-h200-skinny-gemm-qwen3-1.7b.jsonl, Qwen3-8B in
    2026-12-04-h200-skinny-gemm-qwen3-8b.jsonl). Few output rows (N <= 2,048) want narrow
    tiles so that every SM gets a program. At N <= 4,096, 128 programs of 32 rows x 512-deep
    K-tiles keep twice the bytes in flight per SM of 256 programs of 16 x 256: the 8B's down
    projection 31.6 -> 26.9 µs, its o projection 12.9 -> 11.9. Wide outputs (gate|up, the
    vocabulary head) stream best in 64-row tiles, 2-3% over 32 rows; N up to 8,192 (the 8B's
    q|k|v) stays at 32 rows, where 64 lose 2%."""
    if n <= 2048:
        cfg = TileConfig(block_n=16, block_k=256, num_warps=4, num_stages=4)
    elif n <= 4096:
        cfg = TileConfig(block_n=32, block_k=512, num_warps=4, num_stages=4)
    elif n <= 8192:
        cfg = TileConfig(block_n=32, block_k=256, num_warps=4, num_stages=4)
    else:
        return TileConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
    if _SPLIT["sms"]:
        cfg = split_config(n, k, cfg, int(_SPLIT["sms"]))
    return cfg


_SPLIT = {"sms": 0}  # 0: no K splits; else the SMs that split_config fills
SPLIT_MIN_K_TILES = 2  # K-tiles per split program at least
SPLIT_BLOCK_K = 256
SMEM_PER_SM = 228 * 1024  # SM90 (H100 / H200)


def set_split_k(enabled: bool, sms: int = 132) -> None:
    """The runner's `decode_split_k`: from now on `tile_config` splits K for outputs of at most
    8,192 rows (`split_config`), for a device of `sms` multiprocessors (the runner passes its
    device's; 132 on the H100 and H200). Process-wide and set before any launch is captured,
    so a shape's configuration (and with it every row's rounding) is fixed for the process."""
    if enabled and sms < 1:
        raise ValueError(f"sms must be >= 1, got {sms}")
    _SPLIT["sms"] = sms if enabled else 0


_GEMV = {"on": False}  # decode_gemm "gemv": plain narrow products through skinny_gemv


def set_gemv(enabled: bool) -> None:
    """The runner's `decode_gemm = "gemv"`: from now on `skinny_linear` runs the products that
    `skinny_gemv.gemv_config` takes (at most 8,192 output rows and columns) as the register GEMV.
    Process-wide and set before any launch is captured, like `set_split_k`."""
    _GEMV["on"] = enabled


def gemv_products() -> contextlib.AbstractContextManager[None]:
    """`set_gemv(True)` for the launches inside (the runner's one-row executions of
    `decode_single_gemm = "gemv"`: warmed up and captured inside), the switch as it was after."""
    return launch.switched_on(_GEMV, "on")


def pipeline_smem_bytes(cfg: TileConfig, elem_bytes: int = 2) -> int:
    """Shared memory of one program: num_stages - 1 buffered K-tiles of the weight rows and of
    x's 16 (padded) rows, as Triton's SM90 pipeline allocates them (16 x 256 at 4 stages:
    48 KiB; 32 x 512: 144 KiB, so one program per SM)."""
    return (cfg.num_stages - 1) * (cfg.block_n + MAX_ROWS) * cfg.block_k * elem_bytes


def split_config(n: int, k: int, cfg: TileConfig, sms: int) -> TileConfig:
    """`cfg` with K split so that one wave of resident programs covers the output: 256-deep
    K-tiles (a 512-deep tile's pipeline fills an SM's shared memory, so its extra programs
    would queue in later waves), and the largest power-of-two split whose tiles x splits fit
    the SMs' resident programs with at least SPLIT_MIN_K_TILES K-tiles each. Qwen3-1.7B (132
    SMs): o and down 16 x 256 in 4 (4 programs per SM), q|k|v 32 x 256 in 2 (3 per SM); Qwen3-8B:
    q|k|v, o and down 32 x 256 in 2. Unchanged (split 1) where no split fits
    (`benchmarks/skinny_gemm.py --sweep --split` measures the alternatives)."""
    c = replace(cfg, block_k=min(cfg.block_k, SPLIT_BLOCK_K))
    slots = sms * max(1, SMEM_PER_SM // pipeline_smem_bytes(c))
    tiles = -(-n // c.block_n)
    k_tiles = -(-k // c.block_k)
    split = 1
    while tiles * split * 2 <= slots and k_tiles >= 2 * split * SPLIT_MIN_K_TILES:
        split *= 2
    return replace(c, split_k=split) if split > 1 else cfg


@triton.jit
def tile_offsets(
    M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    WIDE_W: tl.constexpr,
):  # fmt: skip
    """A grid (N-tiles, ...) program's offsets: (tile, rows of x, output columns, K offsets,
    the masks of rows and columns, W's row offsets: 64-bit where N * K does not fit 32 bits)."""
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = offs_n
    if WIDE_W:
        w_rows = offs_n.to(tl.int64)
    return pid, offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N, w_rows


@triton.jit
def _skinny_kernel(
    X, W, Y, M, N, s_xm, s_wn, s_ym, NW, R, s_rm, eps, P, CNT,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr = 0, RESIDUAL: tl.constexpr = False, SILU_PAIRS: tl.constexpr = False,
    PDL: tl.constexpr = 0, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64,
    DOT_PRECISION: tl.constexpr = None, WIDE_W: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, K_SPLIT: tl.constexpr = 0,
):  # fmt: skip
    """PROLOGUE 0: x as given; 1: RMSNorm(x) * NW (the row's sum of squares is accumulated
    in the same K loop and its 1/rms applied to the products at the end); 2: SiLU(x[:, :K]) *
    x[:, K:2K] (a fused gate|up output feeding the down projection); 3: RMSNorm with its
    weight folded into W (W = W_orig * NW along K): the sum of squares comes from a separate
    pass over x before the K loop, which is then the plain kernel's, and 1/rms scales the
    products at the end. RESIDUAL: y = (x @ W^T, rounded to Y's dtype) + R, rounded again, as
    `residual + out` in the canonical layer. SILU_PAIRS: W's rows interleave gate and up
    ([g0, u0, g1, u1, ...], N = 2 * Y's columns) and y = SiLU(gate) * up, each rounded as the
    canonical MLP rounds it (gate, up, the activation, the product).

    PDL (launched with programmatic dependent launch, SM90; 0 off, else where the program
    lets the next PDL launch be scheduled: 1 first, 2 after its wait, 3 after its K loop;
    launch.py): the program prefetches the first PREFETCH_LINES cache lines (LINE elements
    each) of its weight rows into L2 (weights are never written during a step, so they need
    no wait), and only then waits for the previous grid to complete and flush (`gdc_wait`)
    before it reads x, the residual or anything else a previous kernel may write. The weight
    stream so starts while the previous kernel drains instead of after it.

    SPLIT_K > 1: grid (N-tiles, SPLIT_K); program (t, s) runs the K loop over K_SPLIT columns
    from s * K_SPLIT (a multiple of BLOCK_K) and stores its fp32 partial in P
    [SPLIT_K, N-tiles, BLOCK_M, BLOCK_N]; the last of a tile's programs to finish (a counter
    per tile in CNT, incremented with acquire-release semantics after the partial is stored,
    reset by that program) sums the partials in split order 0, 1, ... (so the result does not
    depend on which program came last, nor on M) and runs the epilogue. More, shorter weight
    streams: a tile count that leaves SMs idle or unevenly loaded (1,024-4,096 output rows)
    spreads over all of them. Not with PROLOGUE 1 (its sum of squares would be split too)."""
    pid, offs_m, offs_n, offs_k, m_ok, n_ok, w_rows = tile_offsets(
        M, N, BLOCK_M, BLOCK_N, BLOCK_K, WIDE_W
    )
    k_lo = 0
    if SPLIT_K > 1:
        k_lo = tl.program_id(1) * K_SPLIT
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        if PREFETCH_LINES > 0:
            rows = tl.minimum(w_rows, N - 1)  # a ragged last tile prefetches real rows
            cols = tl.minimum(k_lo + tl.arange(0, PREFETCH_LINES) * LINE, K - 1)
            pf = W + rows[:, None] * s_wn + cols[None, :]
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pf], dtype=tl.int32,
                is_pure=False, pack=1,
            )  # fmt: skip
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PROLOGUE == 3:  # x is a few KB and L2-resident: this pass costs no weight bandwidth
        sumsq = rows_sumsq(X, s_xm, offs_m, m_ok, K, BLOCK_M, BLOCK_K)
    k_hi = K
    if SPLIT_K > 1:
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        xm = m_ok[:, None] & k_ok[None, :]
        x = tl.load(X + offs_m[:, None] * s_xm + kk[None, :], mask=xm, other=0.0)
        if PROLOGUE == 1:
            xf = x.to(tl.float32)
            sumsq += tl.sum(xf * xf, axis=1)
            nw = tl.load(NW + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = (xf * nw[None, :]).to(X.dtype.element_ty)
        elif PROLOGUE == 2:
            u = tl.load(X + offs_m[:, None] * s_xm + (kk + K)[None, :], mask=xm, other=0.0)
            gf = x.to(tl.float32)
            act = (gf * tl.sigmoid(gf)).to(X.dtype.element_ty)  # rounded as act_fn's output
            x = (act.to(tl.float32) * u.to(tl.float32)).to(X.dtype.element_ty)
        w = tl.load(W + w_rows[:, None] * s_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT_K == 1:
        tile_epilogue(acc, sumsq, Y, R, pid, offs_m, offs_n, m_ok, n_ok, N, s_ym, s_rm, eps, K,
                  BLOCK_M, BLOCK_N, PROLOGUE, RESIDUAL, SILU_PAIRS)  # fmt: skip
    else:
        last, total = split_tile_sum(P, CNT, acc, offs_m, m_ok, SPLIT_K, BLOCK_M, BLOCK_N)
        if last:
            tile_epilogue(total, sumsq, Y, R, pid, offs_m, offs_n, m_ok, n_ok, N, s_ym, s_rm, eps,
                      K, BLOCK_M, BLOCK_N, PROLOGUE, RESIDUAL, SILU_PAIRS)  # fmt: skip


@triton.jit
def split_partials_sum(P, stride_s, split, acc, m_ok, counter, SPLITS: tl.constexpr):
    """One of SPLITS programs computing a tile's K ranges stores its fp32 partial `acc` at
    P + split * stride_s, then counts itself at `counter` (acquire-release, after every
    thread's stores). Returns (whether it came last, and if so the partials' sum in split
    order 0, 1, ..., so the result does not depend on which program came last); the last
    resets the counter for the next launch."""
    tl.store(P + split * stride_s, acc, mask=m_ok[:, None])
    tl.debug_barrier()  # every thread's partial stores precede the release below
    last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1
    total = tl.zeros_like(acc)
    if last:  # every partial is stored
        tl.debug_barrier()  # the acquire precedes every thread's loads
        total = tl.load(P, mask=m_ok[:, None], other=0.0, cache_modifier=".cg")
        for j in tl.static_range(1, SPLITS):
            total += tl.load(P + j * stride_s, mask=m_ok[:, None], other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(counter, 0, sem="relaxed")
    return last, total


@triton.jit
def split_tile_sum(
    P, CNT, acc, offs_m, m_ok, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """`split_partials_sum` for a grid (N-tiles, SPLITS) whose program (t, s) holds tile t's
    partial over K range s: P [SPLITS, N-tiles, BLOCK_M, BLOCK_N], a counter per tile in CNT."""
    pid = tl.program_id(0)
    tile = (offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]) + pid * (BLOCK_M * BLOCK_N)
    stride_s = tl.num_programs(0) * (BLOCK_M * BLOCK_N)
    return split_partials_sum(P + tile, stride_s, tl.program_id(1), acc, m_ok, CNT + pid, SPLITS)


@triton.jit
def rows_sumsq(X, s_xm, offs_m, m_ok, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Each x row's fp32 sum of squares over all K columns, BLOCK columns at a time (the
    folded RMSNorm's pass over x before the weight stream)."""
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        kk = k0 + tl.arange(0, BLOCK)
        xm = m_ok[:, None] & (kk < K)[None, :]
        xf = tl.load(X + offs_m[:, None] * s_xm + kk[None, :], mask=xm, other=0.0)
        xf = xf.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
    return sumsq


@triton.jit
def tile_epilogue(
    acc, sumsq, Y, R, pid, offs_m, offs_n, m_ok, n_ok, N, s_ym, s_rm, eps,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROLOGUE: tl.constexpr,
    RESIDUAL: tl.constexpr, SILU_PAIRS: tl.constexpr,
):  # fmt: skip
    """The products' fp32 sums -> Y: 1/rms (PROLOGUE 1, 3), SiLU(gate) * up over interleaved
    pairs, or the residual add; each rounded as the canonical modules round it."""
    if PROLOGUE == 1 or PROLOGUE == 3:
        acc = acc * tl.rsqrt(sumsq / K + eps)[:, None]
    if SILU_PAIRS:
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        gate = gate.to(Y.dtype.element_ty).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(Y.dtype.element_ty)  # rounded as act_fn's output
        up = up.to(Y.dtype.element_ty)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(Y.dtype.element_ty)
        offs_j = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        ym = m_ok[:, None] & (offs_j < N // 2)[None, :]
        tl.store(Y + offs_m[:, None] * s_ym + offs_j[None, :], out, mask=ym)
    else:
        out = acc.to(Y.dtype.element_ty)
        ym = m_ok[:, None] & n_ok[None, :]
        if RESIDUAL:
            r = tl.load(R + offs_m[:, None] * s_rm + offs_n[None, :], mask=ym, other=0.0)
            out = (out.to(tl.float32) + r.to(tl.float32)).to(Y.dtype.element_ty)
        tl.store(Y + offs_m[:, None] * s_ym + offs_n[None, :], out, mask=ym)


def skinny_matmul_into(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    cfg: TileConfig | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    folded_norm: bool = False,
    silu_pairs: bool = False,
    pdl: bool | None = None,
    pdl_trigger: str | None = None,
) -> None:
    """y = prologue(x) @ w^T (+ residual): see `_skinny_kernel`. x [M, K] ([M, 2K] with
    `silu_mul`), w [N, K], norm_weight [K], residual [M, N]. `folded_norm`: RMSNorm(x) with
    its weight already folded into w (eps applies); `silu_pairs`: w's rows interleave gate and
    up rows and y [M, N / 2] = SiLU(gate) * up. `pdl`: launch with programmatic dependent
    launch (None: as `launch.set_pdl` chose; only ever on SM90 and newer), triggering the
    next launch at `pdl_trigger` (None: the process-wide choice; launch.py)."""
    m = x.shape[0]
    n, k = w.shape
    if m > MAX_ROWS:
        raise ValueError(f"skinny GEMM takes at most {MAX_ROWS} rows, got {m}")
    if sum((norm_weight is not None, silu_mul, folded_norm)) > 1:
        raise ValueError("one prologue at a time: norm_weight, silu_mul or folded_norm")
    if silu_pairs and (residual is not None or n % 2 or y.shape[1] * 2 != n):
        raise ValueError("silu_pairs: an even N, y with N / 2 columns, no residual")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"x has {x.shape[1]} columns for a [{n}, {k}] weight")
    if x.stride(1) != 1 or w.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("skinny GEMM needs unit stride along K and N")
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError("the residual must have the output's shape, unit stride along N")
    prologue = 1 if norm_weight is not None else 2 if silu_mul else 3 if folded_norm else 0
    c = cfg or tile_config(n, k)
    if cfg is None and prologue == 1 and c.split_k > 1:  # decode_split_k beside "fused" layers
        c = replace(c, split_k=1)
    tiles = triton.cdiv(n, c.block_n)
    splits, k_split = split_plan(k, c)
    if splits > 1 and prologue == 1:
        raise ValueError("split_k cannot run the norm_weight prologue (use folded_norm)")
    partials, counters = split_buffers(y, splits, tiles, c.block_n)
    mode = launch.pdl_mode(x.device, pdl, pdl_trigger)
    lines = prefetch_lines(k_split, c, w.element_size()) if mode else 0
    nw = norm_weight if norm_weight is not None else w  # unread without the norm prologue
    r = residual if residual is not None else y  # unread without the residual
    _skinny_kernel[(tiles, splits)](
        x, w, y, m, n, x.stride(0), w.stride(0), y.stride(0), nw, r, r.stride(0), eps,
        partials, counters,
        K=k, BLOCK_M=MAX_ROWS, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        PROLOGUE=prologue, RESIDUAL=residual is not None, SILU_PAIRS=silu_pairs,
        PDL=mode, PREFETCH_LINES=lines, LINE=CACHE_LINE_BYTES // w.element_size(),
        DOT_PRECISION=launch.dot_precision(w.dtype), WIDE_W=n * w.stride(0) >= 2**31,
        SPLIT_K=splits, K_SPLIT=k_split if splits > 1 else 0,
        num_warps=c.num_warps, num_stages=c.num_stages, launch_pdl=mode > 0,
    )  # fmt: skip


def split_buffers(
    y: torch.Tensor, splits: int, tiles: int, block_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-split launch's fp32 partials [splits, tiles, MAX_ROWS, block_n] and its per-tile
    counters (`launch.zeroed_counters`, shared by every split kernel: launches on one stream
    never overlap); without splits, `y` for both (never read)."""
    if splits == 1:
        return y, y
    partials = torch.empty((splits, tiles, MAX_ROWS, block_n), dtype=torch.float32, device=y.device)
    counters = launch.zeroed_counters("skinny_split_k", y.device, tiles)
    if counters is None:
        raise RuntimeError(
            f"split-K counters for {tiles} tiles were not allocated before graph capture "
            "(run the launch once outside the capture first)"
        )
    return partials, counters


def split_plan(k: int, cfg: TileConfig) -> tuple[int, int]:
    """(programs per N-tile, K columns each): `cfg.split_k` ranges of whole K-tiles, fewer
    where K has fewer K-tiles than that (no program without columns)."""
    k_tiles = -(-k // cfg.block_k)
    per = -(-k_tiles // max(1, cfg.split_k))
    splits = -(-k_tiles // per)
    return splits, per * cfg.block_k if splits > 1 else k


CACHE_LINE_BYTES = 128


def prefetch_lines(k: int, cfg: TileConfig, elem_bytes: int) -> int:
    """Cache lines per weight row a PDL launch prefetches before its wait: what the software
    pipeline's stages hold (num_stages K-tiles), at most the row, as a power of two."""
    line = CACHE_LINE_BYTES // elem_bytes
    lines = min(k, cfg.num_stages * cfg.block_k) // line
    return 1 << (lines.bit_length() - 1) if lines else 0


def _product_into(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, **epilogue: Any) -> None:
    """`skinny_matmul_into(y, x, w, **epilogue)`, or under the GEMV switch (`set_gemv`,
    `gemv_products`) the register GEMV with the same epilogue where `skinny_gemv.gemv_config`
    covers w's shape."""
    if _GEMV["on"]:
        from prep.components import skinny_gemv  # it builds on this module

        cfg = skinny_gemv.gemv_config(*w.shape)
        if cfg is not None:
            skinny_gemv.gemv_into(y, x, w, cfg, **epilogue)
            return
    skinny_matmul_into(y, x, w, **epilogue)


@torch.library.custom_op("flare::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 16) @ w[N, K]^T -> [M, N] in x's dtype, fp32 accumulation."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _product_into(y, x, w)
    return y


@skinny_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def fused_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    silu_mul: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """`skinny_fused`'s contract in the canonical modules' own operations (Llama/Qwen RMSNorm,
    SiLU * up, F.linear, `residual + out`): what runs off CUDA, bit for bit the unfused layer."""
    if norm_weight is not None:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        x = norm_weight * h.to(x.dtype)
    elif silu_mul:
        gate, up = x.chunk(2, dim=-1)
        x = torch.nn.functional.silu(gate) * up
    y = torch.nn.functional.linear(x, w)
    return y if residual is None else residual + y


def fold_norm(w: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """The projection weight with the RMSNorm weight before it folded in (computed in fp32,
    rounded once to w's dtype): `folded_norm`'s w."""
    return (w.to(torch.float32) * norm_weight.to(torch.float32)).to(w.dtype)


def interleave_pairs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[g0, u0, g1, u1, ...] rows from gate [F, K] and up [F, K]: `silu_pairs`'s w."""
    return torch.stack((gate, up), dim=1).reshape(2 * gate.shape[0], gate.shape[1])


def folded_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float | None,
    silu_pairs: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The folded variants' contract in plain operations: x scaled by 1/rms (when `eps` is not
    None) @ w^T, then SiLU(gate) * up over interleaved row pairs, or the residual add."""
    if eps is not None:
        h = x.to(torch.float32)
        x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = torch.nn.functional.linear(x.to(w.dtype), w)
    if silu_pairs:
        gate, up = y[:, 0::2], y[:, 1::2]
        return torch.nn.functional.silu(gate) * up
    return y if residual is None else residual + y


@torch.library.custom_op("flare::skinny_fused", mutates_args=())
def skinny_fused(
    x: torch.Tensor,
    w: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    silu_mul: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """prologue(x) @ w^T (+ residual) for decode-sized x [M, K or 2K], M <= 16: the skinny GEMM
    with the RMSNorm before a projection (norm_weight, eps), or the SiLU * up before the down
    projection (silu_mul), and the residual add after it, in the one launch (on CUDA)."""
    if x.device.type != "cuda":
        return fused_reference(x, w, norm_weight, eps, silu_mul, residual)
    x = x.contiguous()
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    res = None if residual is None else residual.contiguous()
    skinny_matmul_into(y, x, w, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=res)
    return y


@skinny_fused.register_fake
def _(x, w, norm_weight, eps, silu_mul, residual):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0], w.shape[0]))


@torch.library.custom_op("flare::skinny_folded", mutates_args=())
def skinny_folded(
    x: torch.Tensor,
    w: torch.Tensor,
    norm: bool,
    eps: float,
    silu_pairs: bool,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The folded variants for decode-sized x [M, K], M <= 16, in one launch on CUDA: with
    `norm`, RMSNorm(x) whose weight `fold_norm` already folded into w; with `silu_pairs`,
    SiLU(gate) * up from w's interleaved gate/up rows ([M, N / 2]); or the residual add.
    Under the GEMV switch (`set_gemv`, `gemv_products`) the products `skinny_gemv.gemv_config`
    covers run as the register GEMV with the same epilogues. Off CUDA, `folded_reference`."""
    if x.device.type != "cuda":
        return folded_reference(x, w, eps if norm else None, silu_pairs, residual)
    x = x.contiguous()
    n = w.shape[0] // 2 if silu_pairs else w.shape[0]
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    res = None if residual is None else residual.contiguous()
    _product_into(y, x, w, eps=eps, folded_norm=norm, silu_pairs=silu_pairs, residual=res)
    return y


@skinny_folded.register_fake
def _(x, w, norm, eps, silu_pairs, residual):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0], w.shape[0] // 2 if silu_pairs else w.shape[0]))


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with the skinny kernel for decode-sized inputs on CUDA; any leading dims."""
    lead = x.shape[:-1]
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cuda" or rows > MAX_ROWS:
        return torch.nn.functional.linear(x, w, bias)
    y = skinny_linear(x.reshape(rows, x.shape[-1]), w)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, w.shape[0])
