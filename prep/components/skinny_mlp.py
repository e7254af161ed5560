"""A decode step's SiLU MLP in one launch: gate|up, SiLU(gate) * up, then down.

A decode step's products are small: an 8 MiB product wholly in L2 still takes ~5 us on an H100
(benchmarks/results/2026-12-06-h100-decode-attention-prefetch.jsonl), its launch, ramp and
drain, not its memory stream. The MLP is three launches in the skinny path (gate|up, SiLU * up,
down), each paying them. Here one persistent launch does all of it: a few programs per SM
(`MlpConfig.per_sm`, capped by what the compiled kernel lets one SM hold), program p owning the
intermediate tiles p, p + G, ... of G programs (its gate and up rows together, so it stores
SiLU(gate) * up rounded as the canonical MLP rounds each step), then a grid-wide barrier, then
the same programs computing down's output tiles from the whole intermediate vector, each tile's
K optionally split over `split2` work items whose fp32 partials the last of them sums in split
order. Before the barrier each program asks L2 for the first lines of its down items (weights
are never written during a step), so down's stream does not start cold.

The barrier needs every program resident at once: `skinny_mlp_into` reads the compiled kernel's
registers and shared memory and launches no more programs than the SMs hold together, only on
CUDA with nothing else on the stream (a CUDA graph replays kernels one after another), and a
sense counter (GEN) that the last program to arrive advances after resetting the arrival count,
so a launch leaves both as the next one needs them. Triton's interpreter runs programs one after
another, so there (and wherever `persistent=False`) the two phases are two launches of the same
kernel: the results are bitwise the same, which the GPU test pins.

Measured on an H100 (benchmarks/results/2026-12-06-h100-decode-mlp-one-launch.jsonl): alone,
with cold weights, the default configuration takes 34.2 us for the Qwen3-1.7B shape's MLP at
M = 1 against 36.1 for the three-launch chain (8B shape: level, 111 us); served, the 1.7B
decodes level with `skinny` (2.151 / 2.220 / 2.342 ms at c1 / c2 / c4 against 2.156 / 2.229 /
2.336), so `decode_gemm = "mlp"` stays opt-in.

Rows of a decode batch are independent: a row's result depends on its values only (fixed
K-order, the tile's rows padded to MAX_ROWS), never on the rows beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from prep.components import launch
from prep.components.skinny_gemm import MAX_ROWS, TileConfig, split_partials_sum, split_plan


@triton.jit
def grid_barrier(GEN, CNT, grid):
    """A grid-wide barrier of a launch whose `grid` programs are all resident at once: each
    thread's earlier stores are visible to every program's later loads (read those past L1).
    GEN / CNT: int32 (`grid_sync`); the last program to arrive resets the arrival count and
    advances the sense counter, so a launch leaves both as the next one needs them."""
    tl.debug_barrier()  # every thread's stores precede the release below
    gen = tl.atomic_add(GEN, 0, sem="acquire")  # read before arriving: only the last moves it
    if tl.atomic_add(CNT, 1, sem="acq_rel") == grid - 1:
        tl.atomic_xchg(CNT, 0, sem="relaxed")  # for the next launch
        tl.atomic_add(GEN, 1, sem="release")
    else:
        seen = gen
        while seen == gen:
            seen = tl.atomic_add(GEN, 0, sem="acquire")
    tl.debug_barrier()  # the acquire precedes every thread's loads


@triton.jit
def _tile_products(
    X, s_x, W, s_w, rows, r_ok, offs_m, m_ok, second, k_lo, k_hi, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TWO: tl.constexpr,
    X_CACHE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # fp32 x @ W[rows]^T and, with TWO, x @ W[rows + second]^T over K columns [k_lo, k_hi) in
    # one loop (both weight streams in flight together); x's rows beyond m_ok and W's beyond
    # r_ok read as zeros
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
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
    X, WGU, WD, H, Y, GEN, CNT, P, TCNT, M, s_xm, s_gw, s_dw, s_hm, s_ym,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, TILES1: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, ITEMS2: tl.constexpr,
    PHASE: tl.constexpr, SPLIT2: tl.constexpr = 1, K_SPLIT2: tl.constexpr = 0,
    PREFETCH_LINES: tl.constexpr = 0, LINE: tl.constexpr = 64, DOT_PRECISION: tl.constexpr = None,
):  # fmt: skip
    # PHASE 0: both phases with the grid barrier between them; 1: gate|up into H only; 2: down
    # from H only. With G programs, program p owns intermediate tiles p, p + G, ... (TILES1 of
    # them) and down's work items p, p + G, ... (ITEMS2): item i is output tile i // SPLIT2 over
    # K columns [(i % SPLIT2) * K_SPLIT2, + K_SPLIT2). Tiles and items past the end are skipped.
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    n_tiles2 = (HIDDEN + BLOCK_N2 - 1) // BLOCK_N2
    if PHASE != 2:
        for j in range(TILES1):
            t = pid + j * grid
            if t * BLOCK_N1 < INTER:
                rows = t * BLOCK_N1 + tl.arange(0, BLOCK_N1)
                r_ok = rows < INTER
                acc_g, acc_u = _tile_products(
                    X, s_xm, WGU, s_gw, rows, r_ok, offs_m, m_ok, INTER, 0, HIDDEN, HIDDEN,
                    BLOCK_M, BLOCK_N1, BLOCK_K1, True, "", DOT_PRECISION,
                )  # fmt: skip
                # rounded as the canonical MLP rounds: gate and up (the product's output), the
                # activation's output, the product
                gate = acc_g.to(H.dtype.element_ty).to(tl.float32)
                up = acc_u.to(H.dtype.element_ty).to(tl.float32)
                act = (gate * tl.sigmoid(gate)).to(H.dtype.element_ty).to(tl.float32)
                tl.store(H + offs_m[:, None] * s_hm + rows[None, :],
                         (act * up).to(H.dtype.element_ty),
                         mask=m_ok[:, None] & r_ok[None, :])  # fmt: skip
    if PHASE == 0:
        if PREFETCH_LINES > 0:  # the first lines of this program's down items, into L2
            for j in range(ITEMS2):
                i = tl.minimum(pid + j * grid, n_tiles2 * SPLIT2 - 1)
                prow = tl.minimum((i // SPLIT2) * BLOCK_N2 + tl.arange(0, BLOCK_N2), HIDDEN - 1)
                cols = (i % SPLIT2) * K_SPLIT2 + tl.arange(0, PREFETCH_LINES) * LINE
                tl.inline_asm_elementwise(
                    "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                    [WD + prow[:, None] * s_dw + tl.minimum(cols, INTER - 1)[None, :]],
                    dtype=tl.int32, is_pure=False, pack=1,
                )  # fmt: skip
        grid_barrier(GEN, CNT, grid)  # every program's stores of H precede every load of H
    if PHASE != 1:
        for j in range(ITEMS2):
            i = pid + j * grid
            if i < n_tiles2 * SPLIT2:
                t = i // SPLIT2
                rows = t * BLOCK_N2 + tl.arange(0, BLOCK_N2)
                r_ok = rows < HIDDEN
                k_lo = 0
                k_hi = INTER
                if SPLIT2 > 1:
                    k_lo = (i % SPLIT2) * K_SPLIT2
                    k_hi = tl.minimum(k_lo + K_SPLIT2, INTER)
                # H was written by other programs of this launch: read past L1
                acc, _ = _tile_products(
                    H, s_hm, WD, s_dw, rows, r_ok, offs_m, m_ok, 0, k_lo, k_hi, INTER, BLOCK_M,
                    BLOCK_N2, BLOCK_K2, False, ".cg", DOT_PRECISION,
                )  # fmt: skip
                ym = m_ok[:, None] & r_ok[None, :]
                out_ptrs = Y + offs_m[:, None] * s_ym + rows[None, :]
                if SPLIT2 == 1:
                    tl.store(out_ptrs, acc.to(Y.dtype.element_ty), mask=ym)
                else:  # the last of the tile's SPLIT2 items sums their partials and stores
                    tile = offs_m[:, None] * BLOCK_N2 + tl.arange(0, BLOCK_N2)[None, :]
                    last, total = split_partials_sum(
                        P + t * (BLOCK_M * BLOCK_N2) + tile, n_tiles2 * (BLOCK_M * BLOCK_N2),
                        i % SPLIT2, acc, m_ok, TCNT + t, SPLIT2,
                    )  # fmt: skip
                    if last:
                        tl.store(out_ptrs, total.to(Y.dtype.element_ty), mask=ym)


@dataclass(frozen=True)
class MlpConfig:
    """Tiles of the two phases, warps and pipeline stages of the launch, programs per SM (all
    must be resident at once: `skinny_mlp_into` caps them by the compiled kernel's registers
    and shared memory) and the K splits of down's output tiles."""

    block_n1: int = 16  # intermediate rows per phase-1 tile (gate and up: twice the weight rows)
    block_k1: int = 256
    block_n2: int = 16  # output rows per down tile
    block_k2: int = 256
    num_warps: int = 4
    num_stages: int = 3
    per_sm: int = 1
    split2: int = 1  # down's K split into this many items per output tile

    def label(self) -> str:
        return (
            f"{self.block_n1}x{self.block_k1}/{self.block_n2}x{self.block_k2}"
            f"w{self.num_warps}s{self.num_stages}p{self.per_sm}k{self.split2}"
        )


DEFAULT = MlpConfig(block_n1=32, per_sm=2, split2=2)
PREFETCH_LINES = 8  # 128-byte lines of each down item prefetched before the barrier (1 KiB)
_SYNC: dict[tuple[str, torch.device], torch.Tensor] = {}
_OUTGROWN_SYNC: list[torch.Tensor] = []
# the programs each persistent launch runs with, by (device, configuration, hidden, inter,
# dtype, programs asked for): the compiled kernel's residency read once per shape (registers
# and shared memory differ with the shape's constants)
GRIDS: dict[tuple, int] = {}


def programs(device: torch.device, cfg: MlpConfig = DEFAULT) -> int:
    """`cfg.per_sm` programs per SM on CUDA (the caller caps them by residency); 8 elsewhere."""
    if device.type != "cuda":
        return 8
    return cfg.per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def usable_sms(device: torch.device) -> int:
    """The SMs a persistent launch may count on holding its programs at once: the device's,
    scaled down by an MPS client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (its kernels then run on
    that share of the SMs, while the device still reports all of them)."""
    sms = int(torch.cuda.get_device_properties(device).multi_processor_count)
    share = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "").strip()
    try:
        pct = float(share) if share else 100.0
    except ValueError:
        pct = 0.0  # unreadable: assume the worst, no persistent launches
    return int(sms * max(0.0, min(pct, 100.0)) // 100)


def resident_per_sm(kernel: Any, num_warps: int, device: torch.device) -> int:
    """Programs of a compiled kernel that one SM holds at once: by registers (allocated per
    warp in 256s), shared memory (plus the 1 KiB the driver reserves per block), warps and
    blocks."""
    init = getattr(kernel, "_init_handles", None)  # loads the binary: its register count
    if init is not None:
        init()
    props = torch.cuda.get_device_properties(device)
    regs_sm = int(getattr(props, "regs_per_multiprocessor", 65536))
    smem_sm = int(getattr(props, "shared_memory_per_multiprocessor", 233472))
    threads_sm = int(getattr(props, "max_threads_per_multi_processor", 2048))
    regs_warp = -(-int(kernel.n_regs) * 32 // 256) * 256
    by_regs = regs_sm // max(1, regs_warp * num_warps)
    by_smem = smem_sm // (int(kernel.metadata.shared) + 1024)
    return max(0, min(by_regs, by_smem, threads_sm // (32 * num_warps), 32))


def grid_sync(device: torch.device, barriers: int = 1, owner: str = "grid") -> torch.Tensor | None:
    """[GEN, CNT] int32 pairs for `barriers` `grid_barrier`s (pair i at 2 i), zero-initialised
    once outside any capture and shared by every launch of `owner` on `device` (launches on one
    stream never overlap); None while a capture is under way and there are too few (the caller
    then launches its phases separately). A buffer a larger count outgrows stays allocated
    (graphs captured with it replay its address)."""
    have = _SYNC.get((owner, device))
    if have is None or have.numel() < 2 * barriers:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:
            _OUTGROWN_SYNC.append(have)
        have = torch.zeros(2 * max(barriers, 64 if barriers > 1 else 1), dtype=torch.int32,
                           device=device)  # fmt: skip
        _SYNC[(owner, device)] = have
    return have


def skinny_mlp_into(
    y: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    persistent: bool | None = None, num_programs: int | None = None,
    cfg: MlpConfig | None = None,
) -> None:  # fmt: skip
    """y [M, H] = down(SiLU(x @ gate^T) * (x @ up^T)) for x [M, H] (M <= MAX_ROWS), gate_up
    [2 I, H] (gate rows first, then up), down [H, I]. `persistent`: one launch with the grid
    barrier (default: on CUDA); else two launches of the same kernel. `num_programs` replaces
    the configuration's programs per SM (never beyond what is resident, when persistent)."""
    c = cfg or DEFAULT
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
    sync = grid_sync(x.device) if persistent else None
    tiles2 = triton.cdiv(hidden, c.block_n2)
    # down's K in whole K-tiles over at most c.split2 items (no item without columns)
    down_tiles = TileConfig(c.block_n2, c.block_k2, c.num_warps, c.num_stages, c.split2)
    split2, k_split2 = split_plan(inter, down_tiles)
    counters = None
    if split2 > 1:
        counters = launch.zeroed_counters("skinny_mlp", x.device, tiles2)
        if counters is None:
            raise RuntimeError(
                f"skinny MLP counters for {tiles2} tiles were not allocated before graph "
                "capture (run the launch once outside the capture first)"
            )
    if sync is None:
        persistent = False
    p = num_programs or programs(x.device, c)
    h = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    partials = h  # unread without splits
    if split2 > 1:
        partials = torch.empty(
            (split2, tiles2, MAX_ROWS, c.block_n2), dtype=torch.float32, device=x.device
        )
    line = 128 // down.element_size()
    lines = min(PREFETCH_LINES, 1 << max(0, (k_split2 // line).bit_length() - 1))

    def run(grid: int, phase: int, warmup: bool = False) -> Any:
        args = (
            x, gate_up, down, h, y, sync if sync is not None else h,
            sync[1:] if sync is not None else h, partials,
            counters if counters is not None else h, m, x.stride(0), gate_up.stride(0),
            down.stride(0), h.stride(0), y.stride(0),
        )  # fmt: skip
        consts = dict(
            HIDDEN=hidden, INTER=inter, BLOCK_M=MAX_ROWS, BLOCK_N1=c.block_n1,
            BLOCK_K1=c.block_k1, TILES1=triton.cdiv(triton.cdiv(inter, c.block_n1), grid),
            BLOCK_N2=c.block_n2, BLOCK_K2=c.block_k2,
            ITEMS2=triton.cdiv(tiles2 * split2, grid), PHASE=phase, SPLIT2=split2,
            K_SPLIT2=k_split2 if split2 > 1 else 0,
            PREFETCH_LINES=lines if phase == 0 else 0, LINE=line,
            DOT_PRECISION=launch.dot_precision(down.dtype), num_warps=c.num_warps,
            num_stages=c.num_stages,
        )  # fmt: skip
        if warmup:
            return _mlp_kernel.warmup(*args, grid=(grid,), **consts)
        return _mlp_kernel[(grid,)](*args, **consts)

    capped: int | None = 0
    if persistent:
        shape = (x.device, c, hidden, inter, x.dtype, p)
        capped = GRIDS.get(shape)
        if capped is None:
            capped = min(p, _resident(x.device, c, p, run))
            if 0 < capped != p:  # fewer programs: other tile counts per program, compiled again
                capped = min(capped, _resident(x.device, c, capped, run))
            GRIDS[shape] = capped
    if persistent and capped:
        run(capped, 0)
    else:  # two launches (no SMs to count on under an MPS share of 0: the same results)
        run(p, 1)
        run(p, 2)


def _resident(device: torch.device, c: MlpConfig, p: int, run: Any) -> int:
    """Programs of the persistent launch (compiled for `p` programs) that the SMs hold at
    once: its residency per SM times the SMs; at least one per SM, else an error."""
    sms = usable_sms(device)
    per_sm = resident_per_sm(run(p, 0, warmup=True), c.num_warps, device)
    if per_sm < 1:
        raise RuntimeError(f"skinny MLP configuration {c.label()} does not fit one SM")
    return sms * per_sm


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
