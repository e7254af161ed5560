"""Triton paged-attention kernels driven entirely by device-resident metadata.

Why not a host-planned library kernel: decode runs two steps in flight and reads each row's
position and page table from device request state, so the host cannot know the exact lengths
of step N+1 when it enqueues it. These kernels take lengths and pages from device tensors and
need no host plan, so a captured graph replays with whatever the previous step wrote.

Decode (flash-decoding, one launch per layer): triton_decode.py, re-exported here.
Prefill (one request per chunk): grid (Hkv, ceil(T/BLOCK_M), SPLITS), the last query block
first; each program packs BLOCK_M query tokens times the GQA group of one kv head into one tile
and streams key blocks of 128 keys (64 for head dim 256; a few pages, gathered through the page
table) up to the largest position of its query block with an online softmax, masking only the
blocks that reach the diagonal. Short chunks (few query blocks) split the key blocks over SPLITS
programs and merge the partials, as decode does, so an appended turn after a long history is
not serialised on a handful of SMs.

Layouts: q [T, Hq, D]; k/v pages [N+1, PS, Hkv, D] (page N = trash); page_table [B, P] with
-1 = unused (redirected to the trash page, always masked).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS, attention_o, launch
from prep.components.launch import write_tokens_per_program
from prep.components.own_keys import own_keys_heads
from prep.components.triton_decode import (  # noqa: F401 - the decode half, re-exported
    DECODE_SPLITS,
    LOG2E,
    _norm_rope,
    decode_attention,
    decode_attention_from_qkv,
    decode_attention_writing,
    decode_keys,
)


@triton.jit
def _prefill_block(
    q, m_i, l_i, acc, K, V, PT, kpos, qpos, qk_scale, trash, NUM_PT,
    s_kp, s_ks, s_kh, hk, offs_d, PS: tl.constexpr, MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One key block of the online softmax, in base 2 (qk_scale = scale * log2 e, so m_i and
    # the partial maxima are log2-scaled). MASK: the block reaches the diagonal of some row of
    # the query block, so later keys are masked; blocks wholly before the block's first
    # position skip the mask (every row sees every key).
    # key kpos lives in slot kpos % PS of page page_table[kpos // PS] (BLOCK_N / PS pages);
    # a block's tail may run past the table: those keys are later than every query anyway
    page = tl.load(PT + kpos // PS, mask=kpos // PS < NUM_PT, other=-1)
    page = tl.where(page < 0, trash, page)
    kv = page * s_kp + (kpos % PS) * s_ks + hk * s_kh
    k = tl.load(K + kv[:, None] + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M * GPAD, BLOCK_N] fp32
    if MASK:
        qk = tl.where(kpos[None, :] <= qpos[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    m_use = m_new
    if MASK:
        # a split's key blocks can all be later than a row's position: keep it at m = -inf,
        # l = 0 (weight 0 in the merge) without computing exp(-inf - -inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    pr = tl.math.exp2(qk * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    v = tl.load(V + kv[:, None] + offs_d[None, :])
    acc = tl.dot(pr.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    Q, K, V, Out, Mx, Sm, Acc, POS, PT, scale, trash, T, NUM_PT,
    s_qt, s_qh, s_kp, s_ks, s_kh, s_ot, s_oh, s_ms, s_mt, s_as, s_at, s_ah,
    QN, COS, SIN, eps_q, s_cos,
    GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr = None, QK_NORM: tl.constexpr = False,
    ROPE: tl.constexpr = False,
):  # fmt: skip
    # Program (hk, mb, s): BLOCK_M query tokens x the GROUP query heads of kv head hk, packed
    # as BLOCK_M * GPAD rows (row r: token r // GPAD, head hk * GROUP + r % GPAD), so each key
    # block is loaded once per kv head and the dots are BLOCK_M * GPAD tall. The key blocks
    # the query block sees are dealt round-robin to `used` = min(SPLITS, blocks) programs
    # (split-K: a short chunk after a long history still fills the GPU). One program writes
    # the output directly; several write partial (max, sum, acc) for _prefill_merge.
    # Heaviest first: the grid is dealt to SMs in launch order (x fastest), and a causal query
    # block's work grows with its position, so query blocks run from the last to the first,
    # every kv head of one block together; the final wave then holds the lightest programs
    # rather than a kv head's longest ones.
    hk = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    s = tl.program_id(2)
    offs_r = tl.arange(0, BLOCK_M * GPAD)
    tok = mb * BLOCK_M + offs_r // GPAD
    g = offs_r % GPAD
    rmask = (tok < T) & (g < GROUP)
    offs_d = tl.arange(0, D)
    qpos = tl.load(POS + tok, mask=tok < T, other=0)
    if QK_NORM or ROPE:  # Q points into the q|k|v output: each query head's norm and rotation
        q = _norm_rope(Q, tok * s_qt + (hk * GROUP + g) * s_qh, rmask, QN, eps_q, COS, SIN,
                       Q.dtype.element_ty, D, QK_NORM, ROPE, "", tok * s_cos, True)  # fmt: skip
    else:
        q = tl.load(
            Q + tok[:, None] * s_qt + (hk * GROUP + g)[:, None] * s_qh + offs_d[None, :],
            mask=rmask[:, None], other=0.0,
        )  # fmt: skip
    qk_scale = scale * LOG2E
    m_i = tl.full([BLOCK_M * GPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GPAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GPAD, D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    num_keys = tl.max(qpos, 0) + 1  # causal: no row of this block sees a later key
    first = tl.min(tl.where(tok < T, qpos, num_keys), 0)  # every row sees the keys before it
    blocks = tl.cdiv(num_keys, BLOCK_N)
    used = tl.minimum(blocks, SPLITS)
    # this program's blocks are s, s + used, ...; those below `full` need no causal mask
    full = first // BLOCK_N
    n_all = tl.cdiv(tl.maximum(blocks - s, 0), used)
    n_full = tl.minimum(tl.cdiv(tl.maximum(full - s, 0), used), n_all)
    for i in range(0, n_full):
        kpos = (s + i * used) * BLOCK_N + offs_n
        m_i, l_i, acc = _prefill_block(
            q, m_i, l_i, acc, K, V, PT, kpos, qpos, qk_scale, trash, NUM_PT,
            s_kp, s_ks, s_kh, hk, offs_d, PS, False, DOT_PRECISION,
        )  # fmt: skip
    for i in range(n_full, n_all):
        kpos = (s + i * used) * BLOCK_N + offs_n
        m_i, l_i, acc = _prefill_block(
            q, m_i, l_i, acc, K, V, PT, kpos, qpos, qk_scale, trash, NUM_PT,
            s_kp, s_ks, s_kh, hk, offs_d, PS, True, DOT_PRECISION,
        )  # fmt: skip
    head = hk * GROUP + g
    zero = tok * 0  # block-shaped flags (the interpreter masks with blocks only)
    alone = rmask & (zero + used == 1) & (zero + s == 0)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        Out + tok[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty), mask=alone[:, None],
    )  # fmt: skip
    part = rmask & (zero + used > 1) & (zero + s < used)
    tl.store(Mx + s * s_ms + tok * s_mt + head, m_i, mask=part)
    tl.store(Sm + s * s_ms + tok * s_mt + head, l_i, mask=part)
    tl.store(
        Acc + s * s_as + tok[:, None] * s_at + head[:, None] * s_ah + offs_d[None, :], acc,
        mask=part[:, None],
    )  # fmt: skip


@triton.jit
def _prefill_merge(
    Mx, Sm, Acc, Out, POS, T,
    s_ms, s_mt, s_as, s_at, s_ah, s_ot, s_oh,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    # Program (t, hq): combine the partials of token t, query head hq, when its query block
    # was split (the split count is recomputed from the block's positions, as the kernel did).
    t = tl.program_id(0)
    hq = tl.program_id(1)
    offs_b = (t // BLOCK_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    num_keys = tl.max(tl.load(POS + offs_b, mask=offs_b < T, other=0), 0) + 1
    used = tl.minimum(tl.cdiv(num_keys, BLOCK_N), SPLITS)
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    smask = (offs_s < used) & (offs_s * 0 + used > 1)
    m = tl.load(Mx + offs_s * s_ms + t * s_mt + hq, mask=smask, other=float("-inf"))
    lse = tl.load(Sm + offs_s * s_ms + t * s_mt + hq, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)  # log2-scaled maxima
    acc = tl.load(
        Acc + offs_s[:, None] * s_as + t * s_at + hq * s_ah + offs_d[None, :],
        mask=smask[:, None], other=0.0,
    )  # fmt: skip
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(lse * w, 0), 1e-30)
    dmask = offs_d * 0 + used > 1
    tl.store(Out + t * s_ot + hq * s_oh + offs_d, out.to(Out.dtype.element_ty), mask=dmask)


def prefill_tiles(t: int, group: int, d: int, ps: int) -> tuple[int, int, int, int]:
    """(GPAD, BLOCK_M, BLOCK_N, num_warps) by shape: 128 packed rows (BLOCK_M tokens x GPAD
    heads) against key blocks of 128 keys for head dim <= 128 and 64 keys for 256 (or one larger
    page), 8 warps. Chosen by sweeps on the H200 of the 4,096-token causal chunk
    (benchmarks/results/2026-12-03-h200-prefill-attention.jsonl, then
    2026-12-03-h200-prefill-attention-base2.jsonl with the base-2 softmax and unmasked off-diagonal
    blocks): 128 x 128 x 8 warps runs Qwen3-8B's shape at 0.451 ms (305 TFLOP/s) against 0.557
    with 64-key blocks, and Qwen3-1.7B's at 0.265 against 0.32; for head dim 256, 64-key
    blocks (0.447 ms, 308 TFLOP/s) stay best and 128-key blocks do not fit."""
    gpad = triton.next_power_of_2(group)
    block_m = max(1, 128 // gpad)
    if t < block_m:  # short chunks: do not pad the query block far past the tokens
        block_m = max(triton.next_power_of_2(t), max(1, 16 // gpad))
    return gpad, block_m, max(128 if d <= 128 else 64, ps), 8


# split-K while a chunk has at most half this many programs (H200: 132 SMs). Measured on the
# H200: a 128-token chunk after 4,096 keys gains (8B prefix hit 20.9 -> 16.5 ms TTFT), while
# splitting a 512-token chunk that already has 128 programs made it 45% slower (the partials
# and the merge cost more than the extra parallelism gives).
PREFILL_PROGRAMS = 128
MAX_PREFILL_SPLITS = 16


def prefill_splits(t: int, block_m: int, num_kv_heads: int) -> int:
    """Key splits per query block for a chunk of t tokens (static per capacity): enough that
    a short chunk after a long history still gives every SM work; 1 for long chunks, whose
    query blocks alone fill the GPU. The kernel uses min(splits, key blocks) at run time."""
    programs = triton.cdiv(t, block_m) * num_kv_heads
    splits = 1
    while splits < MAX_PREFILL_SPLITS and programs * splits * 2 <= PREFILL_PROGRAMS:
        splits *= 2
    return splits


@triton.jit
def _write_kv_kernel(
    SLOTS, Kin, Vin, K, V, trash_slot, T,
    s_kt, s_kh, s_vt, s_vh, s_kp, s_ks, s_kch, s_vp, s_vs, s_vch,
    KN, COS, SIN, eps_k, s_cos,
    HKV: tl.constexpr, HPAD: tl.constexpr, PS: tl.constexpr, D: tl.constexpr,
    BLOCK_T: tl.constexpr, PDL: tl.constexpr = 0, QK_NORM: tl.constexpr = False,
    ROPE: tl.constexpr = False,
):  # fmt: skip
    # program: BLOCK_T tokens x every kv head, so a 4,096-token chunk moves whole [Hkv, D]
    # rows per token in a few hundred programs (one program per token and head left a prefill
    # launch-bound at a fifth of the copy bandwidth). PDL: see launch.py. QK_NORM / ROPE: Kin
    # points into the q|k|v output and each key gets its RMSNorm (weight KN) and rotation
    # (COS / SIN rows [T, D]) as _norm_rope rounds them before it is written.
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:  # a copy: nothing to overlap after the wait
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    slot = tl.load(SLOTS + t, mask=t_ok, other=-1)
    slot = tl.where(slot < 0, trash_slot, slot)
    page = (slot // PS)[:, None, None]
    off = (slot % PS)[:, None, None]
    h = tl.arange(0, HPAD)[None, :, None]
    d = tl.arange(0, D)[None, None, :]
    ok = t_ok[:, None, None] & (h < HKV)
    tt = t[:, None, None]
    if QK_NORM or ROPE:  # rows (token, head) of the tile, flattened for _norm_rope
        r = tl.arange(0, BLOCK_T * HPAD)
        rt = tl.program_id(0) * BLOCK_T + r // HPAD
        rh = r % HPAD
        k = _norm_rope(Kin, rt * s_kt + rh * s_kh, (rt < T) & (rh < HKV), KN, eps_k, COS, SIN,
                       Kin.dtype.element_ty, D, QK_NORM, ROPE, "", rt * s_cos,
                       True)  # fmt: skip
        k = tl.reshape(k, (BLOCK_T, HPAD, D))
    else:
        k = tl.load(Kin + tt * s_kt + h * s_kh + d, mask=ok, other=0.0)
    v = tl.load(Vin + tt * s_vt + h * s_vh + d, mask=ok, other=0.0)
    tl.store(K + page * s_kp + off * s_ks + h * s_kch + d, k.to(K.dtype.element_ty), mask=ok)
    tl.store(V + page * s_vp + off * s_vs + h * s_vch + d, v.to(V.dtype.element_ty), mask=ok)


@torch.library.custom_op(
    "flare::write_kv_triton", mutates_args=("k_cache", "v_cache"), tags=SHARED_STEP_INPUTS
)
def write_kv_triton(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor,
) -> None:  # fmt: skip
    """The contract of paged_attention.write_kv_pages in one launch for k and v together
    (negative slots go to the trash page)."""
    _write_kv(k_cache, v_cache, slot_mapping, key, value, None)


# (norm weight or None, eps, cos [T, D], sin [T, D]): a q/k RMSNorm and rotary embedding that
# a kernel applies as it loads the heads from the q|k|v output
QKRope = tuple[torch.Tensor | None, float, torch.Tensor, torch.Tensor]


def _write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    key: torch.Tensor, value: torch.Tensor, rope: QKRope | None,
) -> None:  # fmt: skip
    t, hkv, d = key.shape
    if t == 0:
        return
    ps = k_cache.shape[1]
    slot_mapping = launch.unit_stride(slot_mapping)
    block_t = write_tokens_per_program(hkv, d)
    pdl = launch.pdl_mode(key.device)
    norm_w, eps, cos, sin = rope if rope is not None else (None, 0.0, key, key)  # unread
    _write_kv_kernel[(triton.cdiv(t, block_t),)](
        slot_mapping, key, value, k_cache, v_cache, (k_cache.shape[0] - 1) * ps, t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        norm_w if norm_w is not None else key, cos, sin, eps, cos.stride(0),
        HKV=hkv, HPAD=triton.next_power_of_2(hkv), PS=ps, D=d, BLOCK_T=block_t,
        PDL=pdl, QK_NORM=norm_w is not None, ROPE=rope is not None, launch_pdl=pdl > 0,
    )  # fmt: skip


@torch.library.custom_op(
    "flare::prefill_attention_own_keys_from_qkv",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def prefill_attention_own_keys_from_qkv(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
    slots: torch.Tensor, num_q_heads: int, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, eps_q: float, eps_k: float, cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """prefill_attention_from_qkv for a chunk that starts its prompt (AttentionMeta.fresh):
    the same KV write and, in the same launch (own_keys_heads), the query, key and value heads
    normalised and rotated into buffers of their own; then a causal attention over the chunk's
    own keys (paged_attention.causal_own_keys: cuDNN's on CUDA) instead of the paged kernel.
    -> [T, Hq, D]."""
    from prep.components.paged_attention import causal_own_keys

    q, key, value = own_keys_heads(
        qkv, k_cache, v_cache, slots, num_q_heads, q_norm, k_norm, eps_q, eps_k, cos, sin
    )
    return causal_own_keys(q, key, value, scale)


@prefill_attention_own_keys_from_qkv.register_fake
def _(qkv, k_cache, v_cache, scale, slots, num_q_heads, q_norm, k_norm, eps_q, eps_k, cos, sin):  # type: ignore[no-untyped-def]
    return qkv.new_empty((qkv.shape[0], num_q_heads, k_cache.shape[3]))


@torch.library.custom_op(
    "flare::paged_prefill_attention_from_qkv",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def prefill_attention_from_qkv(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    positions: torch.Tensor, scale: float, slots: torch.Tensor, num_q_heads: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps_q: float, eps_k: float,
    cos: torch.Tensor, sin: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """A prefill chunk's attention straight from the q|k|v projection's output qkv
    [T, (Hq + 2 Hkv) * D]: the chunk's keys get their RMSNorm (k_norm, or none) and rotary
    embedding (cos / sin [T, D]) as the KV write loads them, and the query heads theirs as the
    attention loads them (the canonical split, q/k norms, rotary embedding, KV write and
    attention, without the separate norm and rotation kernels). -> [T, Hq, D]."""
    t = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    cos, sin = launch.rotary_rows(cos, sin, t, d)
    page_table, positions = launch.unit_stride(page_table), launch.unit_stride(positions)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q and k norms come together or not at all")
    q, key, value = qkv.view(t, -1, d).split([num_q_heads, hkv, hkv], dim=1)
    _write_kv(k_cache, v_cache, slots, key, value, (k_norm, eps_k, cos, sin))
    _, block_m, _, _ = prefill_tiles(t, num_q_heads // hkv, d, k_cache.shape[1])
    splits = prefill_splits(t, block_m, hkv)
    return prefill_attention_split(
        q, k_cache, v_cache, page_table, positions, scale, splits, rope=(q_norm, eps_q, cos, sin)
    )


@prefill_attention_from_qkv.register_fake
def _(qkv, k_cache, v_cache, page_table, positions, scale, slots, num_q_heads, q_norm, k_norm,  # type: ignore[no-untyped-def]
      eps_q, eps_k, cos, sin):  # fmt: skip
    return qkv.new_empty((qkv.shape[0], num_q_heads, k_cache.shape[3]))


@write_kv_triton.register_fake
def _(k_cache, v_cache, slot_mapping, key, value):  # type: ignore[no-untyped-def]
    return None


@torch.library.custom_op("flare::paged_prefill_attention", mutates_args=(), tags=SHARED_STEP_INPUTS)
def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, positions: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """One request: q [T, Hq, D], page_table [P] (or [1, P]), positions [T] -> [T, Hq, D]."""
    t, hq, d = q.shape
    page_table, positions = launch.unit_stride(page_table), launch.unit_stride(positions)
    _, block_m, _, _ = prefill_tiles(t, hq // k_cache.shape[2], d, k_cache.shape[1])
    splits = prefill_splits(t, block_m, k_cache.shape[2])
    return prefill_attention_split(q, k_cache, v_cache, page_table, positions, scale, splits)


def prefill_attention_split(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, positions: torch.Tensor, scale: float, splits: int,
    tiles: tuple[int, int, int, int] | None = None, stages: int = 2,
    rope: QKRope | None = None,
) -> torch.Tensor:  # fmt: skip
    """prefill_attention with an explicit split count (a power of two; 1 = no split-K), and
    optionally explicit (GPAD, BLOCK_M, BLOCK_N, num_warps) tiles and stages (for sweeps).
    `rope` (q, a view of the q|k|v output): each query head's RMSNorm (or none) and rotary
    embedding applied as the kernel loads it."""
    t, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    norm_w, eps, cos, sin = rope if rope is not None else (None, 0.0, q, q)  # unread without
    gpad, block_m, block_n, warps = tiles or prefill_tiles(t, hq // hkv, d, ps)
    table = page_table.reshape(-1)
    if splits > 1:
        mx = torch.empty((splits, t, hq), dtype=torch.float32, device=q.device)
        sm = torch.empty_like(mx)
        acc = torch.empty((splits, t, hq, d), dtype=torch.float32, device=q.device)
    else:  # never written: the one program per query block stores the output itself
        mx = sm = torch.empty((1, 1, 1), dtype=torch.float32, device=q.device)
        acc = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
    _prefill_kernel[(hkv, triton.cdiv(t, block_m), splits)](
        q, k_cache, v_cache, out, mx, sm, acc, positions, table, scale, k_cache.shape[0] - 1, t,
        table.shape[0],
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), mx.stride(0), mx.stride(1), acc.stride(0), acc.stride(1),
        acc.stride(2), norm_w if norm_w is not None else q, cos, sin, eps, cos.stride(0),
        GROUP=hq // hkv, GPAD=gpad, D=d, PS=ps, BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits,
        DOT_PRECISION=launch.dot_precision(k_cache.dtype), QK_NORM=norm_w is not None,
        ROPE=rope is not None, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _prefill_merge[(t, hq)](
            mx, sm, acc, out, positions, t, mx.stride(0), mx.stride(1), acc.stride(0),
            acc.stride(1), acc.stride(2), out.stride(0), out.stride(1),
            D=d, BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits,
        )  # fmt: skip
    return out


# Opaque to torch.compile: the compiled forward calls the kernels, Inductor fuses around them.
@prefill_attention.register_fake
def _(q, k_cache, v_cache, page_table, positions, scale):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)  # contiguous, as prefill_attention_split allocates it


class TritonAttentionBackend:
    """Binds the kernels to the paged-attention contract (AttentionMeta.backend)."""

    def write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
              key: torch.Tensor, value: torch.Tensor) -> None:  # fmt: skip
        if key.stride(-1) != 1 or value.stride(-1) != 1:
            key, value = key.contiguous(), value.contiguous()
        write_kv_triton(k_cache, v_cache, slots, key, value)

    def run(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        q: torch.Tensor,
        meta: object,
        scale: float,
        window: object,
    ) -> torch.Tensor:
        from prep.components.paged_attention import AttentionMeta

        assert isinstance(meta, AttentionMeta)
        if window is not None:
            raise ValueError("the Triton paged-attention backend does not support sliding windows")
        if meta.mode == "prefill":
            return prefill_attention(q, k, v, meta.page_table, meta.q_pos, scale)
        return decode_attention(q, k, v, meta.page_table, meta.lengths(), scale)

    def write_and_decode(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        meta: object,
        scale: float,
    ) -> torch.Tensor:
        """write(...) then run(...) of a decode step (one new token per row), in one launch."""
        from prep.components.paged_attention import AttentionMeta

        assert isinstance(meta, AttentionMeta) and meta.mode == "decode"
        return decode_attention_writing(
            q, k_cache, v_cache, meta.page_table, meta.lengths(), scale, meta.slot_mapping,
            key, value,
        )  # fmt: skip

    def attend_o(
        self,
        module: torch.nn.Module,
        qkv: torch.Tensor | None,
        residual: torch.Tensor,
        num_q_heads: int,
        norms: tuple[torch.Tensor, torch.Tensor, float, float] | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: object,
        scale: float,
        qkv_weight: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> torch.Tensor | None:
        """`residual + o_proj(attend_from_qkv(qkv, ...))` of a one-row decode step of a request
        without a seed (`AttentionMeta.single_row`) in one launch -> [1, N]; with qkv None,
        residual is the layer input and its q|k|v product over `qkv_weight` (the RMSNorm weight
        folded in, 1/rms with `eps`) runs in that launch too. None where the runner's
        `decode_single_attention` or the layer does not ask for it: the caller then runs the
        separate launches (prep.components.attention_o.single_row)."""
        return attention_o.single_row(
            module, meta, qkv, residual, qkv_weight, eps, num_q_heads, norms, cos, sin, scale
        )

    def attend_from_qkv(
        self,
        module: torch.nn.Module,
        qkv: torch.Tensor,
        num_q_heads: int,
        norms: tuple[torch.Tensor, torch.Tensor, float, float] | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: object,
        scale: float,
    ) -> torch.Tensor:
        """The attention of layer `module` from its q|k|v output [N, W] (N rows of a decode
        step or tokens of a prefill chunk) -> [N, Hq * D]: the q/k norms (or none) and rotary
        embedding (cos / sin [N, D]) inside the kernels. Decode: norms, rotation, KV write and
        attention in one launch; prefill: the KV write rotates the keys, the attention the
        query heads."""
        from prep.components.paged_attention import AttentionMeta, layer_pages

        assert isinstance(meta, AttentionMeta)
        k_cache, v_cache = layer_pages(module, meta)
        qn, kn, eps_q, eps_k = norms if norms is not None else (None, None, 0.0, 0.0)
        if meta.mode == "decode":
            # the o projection runs next: its weight may be warmed in L2 meanwhile (launch.py)
            o_proj = getattr(module, "o_proj", None)
            out = decode_attention_from_qkv(
                qkv, k_cache, v_cache, meta.page_table, meta.lengths(), scale, meta.slot_mapping,
                num_q_heads, qn, kn, eps_q, eps_k, cos, sin,
                o_proj.weight if isinstance(o_proj, torch.nn.Linear) else None,
            )  # fmt: skip
        elif meta.fresh:  # the chunk starts its prompt: its keys are all its own
            out = prefill_attention_own_keys_from_qkv(
                qkv, k_cache, v_cache, scale, meta.slot_mapping, num_q_heads, qn, kn, eps_q,
                eps_k, cos.contiguous(), sin.contiguous(),
            )  # fmt: skip
        else:
            out = prefill_attention_from_qkv(
                qkv, k_cache, v_cache, meta.page_table, meta.q_pos, scale, meta.slot_mapping,
                num_q_heads, qn, kn, eps_q, eps_k, cos.contiguous(), sin.contiguous(),
            )  # fmt: skip
        return out.view(qkv.shape[0], -1)
