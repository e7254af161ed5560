"""A one-row decode step's attention and o projection in one launch.

At one decode row a layer's attention is a short chain of dependent loads (the row's length,
its page table, a block of keys and values, the split programs' merge) that leaves the memory
nearly idle for several microseconds, and the o projection after it is a weight stream of
8-32 MiB whose launch, ramp and drain cost more than its bytes (an 8 MiB product wholly in L2
still took ~5 us on an H100: benchmarks/results/2026-12-06-h100-decode-attention-prefetch.jsonl).
Here the attention's programs (`triton_decode._decode_partial` as `decode_attention_from_qkv`
runs it: q/k norms, rotary embedding, the new token's KV write, the split attention and the
last program's merge) go on to the o projection after a grid-wide barrier
(`skinny_mlp.grid_barrier`): program p owns output rows [p R, (p + 1) R) and loads their first
weight chunk before it arrives, so the weight stream starts while the last merges run and the
product pays no launch of its own. The residual add is its epilogue.

The barrier needs every program resident at once (grid (1, Hkv, SPLITS): 128 programs for 8
KV heads, one per SM of an H100 or H200): `decode_attention_o_from_qkv` reads the compiled
kernel's residency and otherwise, or while a capture lacks the barrier's counters, or under
Triton's interpreter (programs one after another), launches the two phases as two launches of
the same kernel, bitwise the same results.

Arithmetic: the attention output is `decode_attention_from_qkv`'s, rounded to the dtype as the
canonical attention's output is; each o output row is an fp32 sum over K (lane-wise over the
chunks, then across the lanes), rounded to the dtype, plus the residual in fp32, rounded again
(`residual + o_proj(attn)`). The summation order differs from the skinny products', so a row's
result depends on running through this launch: it is for the one-row executions of requests
without a seed (`AttentionMeta.single_row`), which promise nothing about batch invariance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS, launch
from prep.components.skinny_mlp import grid_barrier, grid_sync, resident_per_sm
from prep.components.triton_decode import DECODE_SPLITS, _decode_partial, decode_keys

NUM_WARPS = 8
# o weight elements a program holds per chunk (two chunks in flight: 64 KiB of bf16 an SM)
CHUNK_ELEMENTS = 16384
_STATE: dict[str, int] = {"on": 1, "warm": 0}
# the programs an SM holds of each compiled shape: (device, constants) -> count
_RESIDENT: dict[tuple, int] = {}


def set_enabled(on: bool) -> None:
    """Whether one-row decode steps run their attention and o projection as this one launch
    (read when a layer is traced or run, so set it before the runner warms up and captures;
    off: `decode_attention_from_qkv` then the o product, as before)."""
    _STATE["on"] = int(bool(on))


def enabled() -> bool:
    return bool(_STATE["on"])


def o_tiles(n: int, programs: int, k: int) -> tuple[int, int]:
    """(output rows per program: a power of two covering n over `programs`; K columns per
    chunk: CHUNK_ELEMENTS over those rows, a power of two, at most K's)."""
    rows = triton.next_power_of_2(-(-n // programs))
    chunk = min(triton.next_power_of_2(k), max(16, CHUNK_ELEMENTS // rows))
    return rows, chunk


@triton.jit
def _attention_o_kernel(
    Q, K, V, PT, LEN, Mx, Sm, Acc, ATT, CNT, SLOTS, Kin, Vin, QN, KN, COS, SIN, W, WW, R, Y,
    SYNC, scale, trash, eps_q, eps_k, n_out, w_words,
    s_qh, s_kp, s_ks, s_kh, s_pt, s_mh, s_ah, s_as, s_oh, s_kih, s_vih, s_cos, s_w,
    GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, QK_NORM: tl.constexpr, ROPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KO: tl.constexpr, ROWS: tl.constexpr, CHUNK: tl.constexpr,
    PHASE: tl.constexpr, WARM: tl.constexpr = 0,
):  # fmt: skip
    # PHASE 0: the attention, the grid barrier, the o product; 1: the attention only (into
    # ATT); 2: the o product only (from ATT). WARM 2: the attention's programs ask L2 for the
    # o weight (int32 words WW) once their partials are stored (each about its own rows).
    prog = tl.program_id(1) * SPLITS + tl.program_id(2)
    grid = tl.num_programs(1) * SPLITS
    if PHASE != 2:
        _decode_partial(
            Q, K, V, PT, LEN, Mx, Sm, Acc, ATT, CNT, SLOTS, Kin, Vin, QN, KN, COS, SIN, WW,
            scale, trash, eps_q, eps_k, w_words,
            0, s_qh, s_kp, s_ks, s_kh, s_pt, 0, s_mh, 0, s_ah, s_as, 0, s_oh, 0, s_kih, 0,
            s_vih, s_cos,
            GROUP=GROUP, GPAD=GPAD, D=D, PS=PS, BLOCK_N=BLOCK_N, SPLITS=SPLITS, PDL=0,
            LAST_MERGES=True, WRITE_KV=True, QK_NORM=QK_NORM, ROPE=ROPE,
            DOT_PRECISION=DOT_PRECISION, PREFETCH=WARM,
        )  # fmt: skip
    if PHASE != 1:
        rows = prog * ROWS + tl.arange(0, ROWS)
        r_ok = rows < n_out
        cols = tl.arange(0, CHUNK)
        w_rows = W + rows[:, None].to(tl.int64) * s_w
        w = tl.load(w_rows + cols[None, :], mask=r_ok[:, None] & (cols < KO)[None, :], other=0.0)
        if PHASE == 0:
            grid_barrier(SYNC, SYNC + 1, grid)  # every merge's ATT stores precede the loads
        acc = tl.zeros((ROWS, CHUNK), dtype=tl.float32)
        for k0 in range(0, KO, CHUNK):
            nxt = k0 + CHUNK + cols  # the next chunk's loads go out before this one is used
            w_next = tl.load(w_rows + nxt[None, :], mask=r_ok[:, None] & (nxt < KO)[None, :],
                             other=0.0)  # fmt: skip
            kk = k0 + cols
            x = tl.load(ATT + kk, mask=kk < KO, other=0.0, cache_modifier=".cg")
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w = w_next
        out = tl.sum(acc, 1).to(Y.dtype.element_ty)  # o_proj's output, rounded
        res = tl.load(R + rows, mask=r_ok, other=0.0)
        tl.store(Y + rows, (out.to(tl.float32) + res.to(tl.float32)).to(Y.dtype.element_ty),
                 mask=r_ok)  # fmt: skip


@torch.library.custom_op(
    "flare::paged_decode_attention_o_from_qkv",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def decode_attention_o_from_qkv(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, slots: torch.Tensor, num_q_heads: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps_q: float, eps_k: float,
    cos: torch.Tensor, sin: torch.Tensor, o_weight: torch.Tensor, residual: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """residual [1, N] + o_weight [N, Hq * D] @ the attention of one decode row from its q|k|v
    output qkv [1, (Hq + 2 Hkv) * D] (as `triton_decode.decode_attention_from_qkv`: q/k norms
    or none, rotary embedding cos / sin [1, D], the new key and value written to `slots`), in
    one launch where its programs fit the SMs at once. -> [1, N]."""
    if qkv.shape[0] != 1 or residual.shape[0] != 1:
        raise ValueError(f"one decode row only, got {qkv.shape[0]}")
    hkv, d, ps = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    n, ko = o_weight.shape
    if ko != num_q_heads * d or tuple(residual.shape) != (1, n):
        raise ValueError(
            f"o weight {tuple(o_weight.shape)} and residual {tuple(residual.shape)} do not fit "
            f"{num_q_heads} heads of {d}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the k and v pages must share one layout")
    if o_weight.stride(1) != 1:
        raise ValueError("the o weight needs unit stride along K")
    heads = qkv.view(1, -1, d)
    q, key, value = heads.split([num_q_heads, hkv, hkv], dim=1)
    if heads.stride(-1) != 1:
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
    group = num_q_heads // hkv
    splits = DECODE_SPLITS
    grid = hkv * splits
    mx = torch.empty((1, num_q_heads, splits), dtype=torch.float32, device=qkv.device)
    sm = torch.empty_like(mx)
    acc = torch.empty((1, num_q_heads, splits, d), dtype=torch.float32, device=qkv.device)
    att = torch.empty((1, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    y = torch.empty((1, n), dtype=qkv.dtype, device=qkv.device)
    counters = launch.zeroed_counters("decode_attention", qkv.device, hkv)
    if counters is None:
        raise RuntimeError(
            "decode attention counters were not allocated before graph capture "
            "(run the launch once outside the capture first)"
        )
    page_table, seq_lens = launch.unit_stride(page_table), launch.unit_stride(seq_lens)
    slots, residual = launch.unit_stride(slots), residual.contiguous()
    norms = q_norm is not None and k_norm is not None
    qn, kn = (q_norm, k_norm) if q_norm is not None and k_norm is not None else (q, q)
    cos, sin = launch.rotary_rows(cos, sin, 1, d)
    words = launch.prefetch_words(o_weight)
    warm = _STATE["warm"] if words is not None else 0
    rows, chunk = o_tiles(n, grid, ko)
    sync = grid_sync(qkv.device) if qkv.device.type == "cuda" else None

    def run(phase: int, warmup: bool = False) -> object:
        args = (
            q, k_cache, v_cache, page_table, seq_lens, mx, sm, acc, att, counters, slots, key,
            value, qn, kn, cos, sin, o_weight, words if warm and words is not None else seq_lens,
            residual, y, sync if sync is not None else counters,
            scale, k_cache.shape[0] - 1, eps_q, eps_k, n, words.numel() if warm else 0,
            q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            page_table.stride(0), mx.stride(1), acc.stride(1), acc.stride(2), att.stride(1),
            key.stride(1), value.stride(1), cos.stride(0), o_weight.stride(0),
        )  # fmt: skip
        consts = dict(
            GROUP=group, GPAD=max(16, triton.next_power_of_2(group)), D=d, PS=ps,
            BLOCK_N=decode_keys(ps), SPLITS=splits, QK_NORM=norms, ROPE=True,
            DOT_PRECISION=launch.dot_precision(k_cache.dtype), KO=ko, ROWS=rows, CHUNK=chunk,
            PHASE=phase, WARM=warm if phase != 2 else 0, num_warps=NUM_WARPS,
        )  # fmt: skip
        if warmup:
            return _attention_o_kernel.warmup(*args, grid=(1, hkv, splits), **consts)
        return _attention_o_kernel[(1, hkv, splits)](*args, **consts)

    shape = (n, ko, hkv, d, ps, group, norms, warm, qkv.dtype, NUM_WARPS, CHUNK_ELEMENTS)
    if sync is not None and _fits(qkv.device, shape, grid, run):
        run(0)
    else:
        run(1)
        run(2)
    return y


def _fits(device: torch.device, key: tuple, grid: int, run: object) -> bool:
    """Whether the `grid` programs of the one-launch form are resident on `device` at once
    (the compiled kernel's registers and shared memory; read once per shape)."""
    k = (device, *key)
    per_sm = _RESIDENT.get(k)
    if per_sm is None:
        kernel = run(0, warmup=True)  # type: ignore[operator]
        per_sm = _RESIDENT[k] = resident_per_sm(kernel, NUM_WARPS, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return grid <= per_sm * sms


def set_warm(where: int) -> None:
    """0: no L2 warming of the o weight; 2: the attention's programs ask L2 for it once their
    partials are stored (an experiment's switch, read at launch)."""
    if where not in (0, 2):
        raise ValueError(f"warm must be 0 or 2, got {where}")
    _STATE["warm"] = where


@decode_attention_o_from_qkv.register_fake
def _(qkv, k_cache, v_cache, page_table, seq_lens, scale, slots, num_q_heads, q_norm, k_norm,  # type: ignore[no-untyped-def]
      eps_q, eps_k, cos, sin, o_weight, residual):  # fmt: skip
    return residual.new_empty((1, o_weight.shape[0]))
