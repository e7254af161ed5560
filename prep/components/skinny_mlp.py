"""A decode step's SiLU MLP in one launch: gate|up, SiLU(gate) * up, then down.

A decode step's products are small: an 8 MiB product wholly in L2 still takes ~5 us on an H100
(benchmarks/results/2026-12-06-h100-decode-attention-prefetch.jsonl), its launch, ramp and
drain, not its memory stream. The MLP is three launches in the skinny path (gate|up, SiLU * up,
down), each paying them. Here one persistent launch does all of it: one program per SM, each
owning a contiguous range of the intermediate rows (its gate and up rows together, so it stores
SiLU(gate) * up rounded as the canonical MLP rounds each step), then a grid-wide barrier, then
the same programs computing down's output rows from the whole intermediate vector. Before the
barrier each program asks L2 for the first K-tiles of its down rows (weights are never written
during a step), so down's stream does not start cold.

The barrier needs every program resident at once: one program per SM, launched only on CUDA
with nothing else on the stream (a CUDA graph replays kernels one after another), and a sense
counter (GEN) that the last program to arrive advances after resetting the arrival count, so a
launch leaves both as the next one needs them. Triton's interpreter runs programs one after
another, so there (and wherever `persistent=False`) the two phases are two launches of the same
kernel: the results are bitwise the same, which the GPU test pins.

Rows of a decode batch are independent: a row's result depends on its values only (fixed
K-order, the tile's rows padded to MAX_ROWS), never on the rows beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import launch
from prep.components.skinny_gemm import MAX_ROWS


@triton.jit
def _tile_products(
    X, s_x, W, s_w, rows, r_ok, offs_m, m_ok, second, K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr, X_CACHE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # fp32 x @ W[rows]^T and, with TWO, x @ W[rows + second]^T over K in one loop (both weight
    # streams in flight together); x's rows beyond m_ok and W's beyond r_ok read as zeros
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(X + offs_m[:, None] * s_x + kk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0, cache_modifier=X_CACHE)  # fmt: skip
        wmask = r_ok[:, None] & k_ok[None, :]
        w = tl.load(W + rows[:, None] * s_w + kk[None, :], mask=wmask, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if TWO:
            w2 = tl.load(W + (rows + second)[:, None] * s_w + kk[None, :], mask=wmask, other=0.0)
            acc2 = tl.dot(x, tl.trans(w2), acc2, input_precision=DOT_PRECISION)
    return acc, acc2


@triton.jit
def _mlp_kernel(
    X, WGU, WD, H, Y, GEN, CNT, M, s_xm, s_gw, s_dw, s_hm, s_ym,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, TILES1: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, TILES2: tl.constexpr,
    PHASE: tl.constexpr, PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64,
    DOT_PRECISION: tl.constexpr = None,
):  # fmt: skip
    # PHASE 0: both phases with the grid barrier between them; 1: gate|up into H only; 2: down
    # from H only. Program p owns intermediate tiles [p * TILES1, (p + 1) * TILES1) and output
    # tiles [p * TILES2, (p + 1) * TILES2) (tiles past the end are masked away).
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    if PHASE != 2:
        for j in range(TILES1):
            rows = (pid * TILES1 + j) * BLOCK_N1 + tl.arange(0, BLOCK_N1)
            r_ok = rows < INTER
            acc_g, acc_u = _tile_products(
                X, s_xm, WGU, s_gw, rows, r_ok, offs_m, m_ok, INTER, HIDDEN, BLOCK_M, BLOCK_N1,
                BLOCK_K1, True, "", DOT_PRECISION,
            )  # fmt: skip
            # rounded as the canonical MLP rounds: gate and up (the product's output), the
            # activation's output, the product
            gate = acc_g.to(H.dtype.element_ty).to(tl.float32)
            up = acc_u.to(H.dtype.element_ty).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(H.dtype.element_ty).to(tl.float32)
            tl.store(H + offs_m[:, None] * s_hm + rows[None, :], (act * up).to(H.dtype.element_ty),
                     mask=m_ok[:, None] & r_ok[None, :])  # fmt: skip
    if PHASE == 0:
        if PREFETCH_LINES > 0:  # the first lines of this program's down rows, into L2
            for j in range(TILES2):
                prow = tl.minimum((pid * TILES2 + j) * BLOCK_N2 + tl.arange(0, BLOCK_N2),
                                  HIDDEN - 1)  # fmt: skip
                cols = tl.arange(0, PREFETCH_LINES) * LINE
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                    [WD + prow[:, None] * s_dw + cols[None, :]], dtype=tl.int32,
                    is_pure=False, pack=1,
                )  # fmt: skip
        tl.debug_barrier()  # every thread's stores of H precede the release below
        gen = tl.atomic_add(GEN, 0, sem="acquire")  # read before arriving: only the last moves it
        if tl.atomic_add(CNT, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(CNT, 0, sem="relaxed")  # for the next launch
            tl.atomic_add(GEN, 1, sem="release")
        else:
            seen = gen
            while seen == gen:
                seen = tl.atomic_add(GEN, 0, sem="acquire")
        tl.debug_barrier()  # the acquire precedes every thread's loads of H
    if PHASE != 1:
        for j in range(TILES2):
            rows = (pid * TILES2 + j) * BLOCK_N2 + tl.arange(0, BLOCK_N2)
            r_ok = rows < HIDDEN
            # H was written by other programs of this launch: read past L1
            acc, _ = _tile_products(
                H, s_hm, WD, s_dw, rows, r_ok, offs_m, m_ok, 0, INTER, BLOCK_M, BLOCK_N2,
                BLOCK_K2, False, ".cg", DOT_PRECISION,
            )  # fmt: skip
            tl.store(Y + offs_m[:, None] * s_ym + rows[None, :], acc.to(Y.dtype.element_ty),
                     mask=m_ok[:, None] & r_ok[None, :])  # fmt: skip


# tiles: 16 intermediate rows (gate and up: 32 weight rows) x 256-deep K-tiles, 16 output rows
# x 256; 4 warps, 3 stages (each stage holds x and two weight tiles: ~24 KiB)
BLOCK_N1, BLOCK_K1, BLOCK_N2, BLOCK_K2, NUM_WARPS, NUM_STAGES = 16, 256, 16, 256, 4, 3
PREFETCH_LINES = 8  # 128-byte lines of each down row prefetched before the barrier (1 KiB)
_SYNC: dict[torch.device, torch.Tensor] = {}


def programs(device: torch.device) -> int:
    """One program per SM on CUDA (all resident at once, as the barrier needs); 8 elsewhere."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _sync(device: torch.device) -> torch.Tensor | None:
    """[GEN, CNT] int32 for the barrier, zero-initialised once outside any capture and shared
    by every launch on `device` (launches on one stream never overlap); None while a capture is
    under way and there are none yet (the caller then launches the two phases separately)."""
    have = _SYNC.get(device)
    if have is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        have = _SYNC[device] = torch.zeros(2, dtype=torch.int32, device=device)
    return have


def skinny_mlp_into(
    y: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    persistent: bool | None = None, num_programs: int | None = None,
) -> None:  # fmt: skip
    """y [M, H] = down(SiLU(x @ gate^T) * (x @ up^T)) for x [M, H] (M <= MAX_ROWS), gate_up
    [2 I, H] (gate rows first, then up), down [H, I]. `persistent`: one launch with the grid
    barrier (default: on CUDA); else two launches of the same kernel."""
    m, hidden = x.shape
    inter = down.shape[1]
    if m > MAX_ROWS:
        raise ValueError(f"skinny MLP takes at most {MAX_ROWS} rows, got {m}")
    if tuple(gate_up.shape) != (2 * inter, hidden) or tuple(down.shape) != (hidden, inter):
        raise ValueError(
            f"skinny MLP: gate|up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
            f"fit x with {hidden} columns"
        )
    if min(x.stride(1), gate_up.stride(1), down.stride(1), y.stride(1)) != 1:
        raise ValueError("skinny MLP needs unit stride along each row")
    if persistent is None:
        persistent = x.device.type == "cuda"
    sync = _sync(x.device) if persistent else None
    persistent = sync is not None
    p = num_programs or programs(x.device)
    tiles1 = triton.cdiv(triton.cdiv(inter, BLOCK_N1), p)
    tiles2 = triton.cdiv(triton.cdiv(hidden, BLOCK_N2), p)
    h = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if sync is None:
        sync = h  # unread without the barrier
    common = (
        x, gate_up, down, h, y, sync, sync[1:], m, x.stride(0), gate_up.stride(0),
        down.stride(0), h.stride(0), y.stride(0),
    )  # fmt: skip
    consts = dict(
        HIDDEN=hidden, INTER=inter, BLOCK_M=MAX_ROWS, BLOCK_N1=BLOCK_N1, BLOCK_K1=BLOCK_K1,
        TILES1=tiles1, BLOCK_N2=BLOCK_N2, BLOCK_K2=BLOCK_K2, TILES2=tiles2,
        DOT_PRECISION=launch.dot_precision(down.dtype), num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )  # fmt: skip
    if persistent:
        line = 128 // down.element_size()
        lines = min(PREFETCH_LINES, 1 << max(0, (inter // line).bit_length() - 1))
        _mlp_kernel[(p,)](*common, PHASE=0, PREFETCH_LINES=lines, LINE=line, **consts)
    else:
        _mlp_kernel[(p,)](*common, PHASE=1, **consts)
        _mlp_kernel[(p,)](*common, PHASE=2, **consts)


@torch.library.custom_op("flare::skinny_mlp", mutates_args=())
def skinny_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`skinny_mlp_into` into a new [M, H] tensor (x made contiguous)."""
    x = x.contiguous()
    y = torch.empty((x.shape[0], down.shape[0]), dtype=x.dtype, device=x.device)
    skinny_mlp_into(y, x, gate_up, down)
    return y


@skinny_mlp.register_fake
def _(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], down.shape[0]))
