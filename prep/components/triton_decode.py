"""Triton paged decode attention: one query token per row, driven by device-resident metadata.

Flash-decoding: grid (B, Hkv, SPLITS). Program (b, h, s) handles the key blocks (64 keys:
several pages gathered through the page table) s, s+SPLITS, ... of row b for the query heads
of kv head h (GQA group padded to 16 rows for tl.dot) with a base-2 online softmax and stores a
partial (max, sum, acc); the last of the SPLITS programs of (b, h) to finish merges them (or a
second kernel does, `MERGE_IN_LAST_PROGRAM = False`). The program whose key blocks hold the
row's new position can also write the new token's key and value first, and, reading the q|k|v
projection's output, apply the q/k RMSNorm and the rotary embedding, so a decode layer's
attention is one launch (`decode_attention_from_qkv`). Layouts as in triton_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS, launch

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # softmax in base 2: exp(x) = 2^(x log2 e)
DECODE_SPLITS = 16
# keys per decode iteration: several pages per dot, so a long row is not a chain of one-page
# dependent loads (at 4,096 keys, one 16-slot page per iteration ran the 8B shape's decode
# attention at ~20% of the copy bandwidth: 22 us per layer for 4.2 MB of keys and values)
DECODE_KEYS = 64
# at most this many keys per iteration even where a page holds more (None: one page then)
DECODE_KEYS_MAX: int | None = None
# warps per _decode_partial program: 4, as measured served so far (compiled for SM90 with the
# launch's 16-divisible strides, the served launch holds 128 registers and
# spills nothing). 8 warps (twice the threads issuing a latency-bound program's loads) and
# DECODE_KEYS_MAX = 32 (at ~600 keys all 16 splits of a head busy instead of ~10; a long row
# then takes twice the iterations) are not yet measured: decode_latency.py's `aw8` / `ak32`.
DECODE_WARPS = 4


def decode_keys(ps: int) -> int:
    """Keys per iteration of _decode_partial: DECODE_KEYS, or one page when pages are larger,
    at most DECODE_KEYS_MAX (a block within a page: its keys still gathered one by one)."""
    keys = max(DECODE_KEYS, ps)
    return keys if DECODE_KEYS_MAX is None else min(keys, DECODE_KEYS_MAX)


@triton.jit
def prefetch_l2(W, n_words, prog, progs, BLOCK: tl.constexpr):
    """Program `prog` of `progs` asks L2 for its share of the int32 words W[0:n_words] (whole
    128-byte lines, one `prefetch.global.L2` each, BLOCK lines per iteration). A hint: nothing
    waits for it, it changes no result, and W must not be written while it may be in flight."""
    per = tl.cdiv(tl.cdiv(n_words, progs), 32) * 32
    lo = prog * per
    hi = tl.minimum(lo + per, n_words)
    offs = tl.arange(0, BLOCK) * 32
    for start in range(lo, hi, BLOCK * 32):
        line = tl.where(start + offs < hi, start + offs, lo)  # past the range: its first line
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [W + line], dtype=tl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _merge_splits(
    Mx, Sm, Acc, Out, b, hq, s_mb, s_mh, s_ab, s_ah, s_as, s_ot, s_oh,
    D: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Query head hq of row b from its SPLITS partials (log2-scaled maxima, sums, accs), read
    past L1 (other programs wrote them during this launch)."""
    offs_s = tl.arange(0, SPLITS)
    offs_d = tl.arange(0, D)
    m = tl.load(Mx + b * s_mb + hq * s_mh + offs_s, cache_modifier=".cg")
    lse = tl.load(Sm + b * s_mb + hq * s_mh + offs_s, cache_modifier=".cg")
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)  # log2-scaled maxima
    acc = tl.load(
        Acc + b * s_ab + hq * s_ah + offs_s[:, None] * s_as + offs_d[None, :], cache_modifier=".cg"
    )
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(lse * w, 0)
    out = num / tl.maximum(den, 1e-30)
    tl.store(Out + b * s_ot + hq * s_oh + offs_d, out.to(Out.dtype.element_ty))


@triton.jit
def _norm_rope(
    X, rows, row_ok, NW, eps, COS, SIN, DT: tl.constexpr, D: tl.constexpr,
    NORM: tl.constexpr, ROPE: tl.constexpr, CACHE: tl.constexpr, crows=0,
    PER_ROW: tl.constexpr = False,
):  # fmt: skip
    """Heads X[rows, :D] ([R] offsets) -> RMSNorm (weight NW, eps) then rotary embedding (the
    row's COS/SIN [D], or with PER_ROW each row's at COS/SIN + crows [R]: a prefill chunk's
    tokens), each step rounded to DT where the canonical modules round: the norm's fp32 result
    to DT before its weight, q * cos, rotate_half(q) * sin and their sum. CACHE: X's loads'
    cache modifier (".cg" where other programs of the same launch wrote X; "" for the default).
    CACHE has no default on purpose: a device function's string default is not bound as a
    constexpr by every Triton release (3.6 fails with "'str' object has no attribute 'type'"),
    so each caller names it."""
    offs_d = tl.arange(0, D)
    perm = (offs_d + D // 2) % D  # rotate_half: [-x2, x1]
    x = tl.load(X + rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                cache_modifier=CACHE)  # fmt: skip
    xp = tl.load(X + rows[:, None] + perm[None, :], mask=row_ok[:, None], other=0.0,
                 cache_modifier=CACHE)  # fmt: skip
    x = x.to(tl.float32)
    xp = xp.to(tl.float32)
    if NORM:
        r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        w = tl.load(NW + offs_d).to(tl.float32)
        wp = tl.load(NW + perm).to(tl.float32)
        x = (w[None, :] * (x * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
        xp = (wp[None, :] * (xp * r).to(DT).to(tl.float32)).to(DT).to(tl.float32)
    if ROPE:
        sign = tl.where(offs_d < D // 2, -1.0, 1.0)
        if PER_ROW:
            cd = crows[:, None] + offs_d[None, :]
            c = tl.load(COS + cd, mask=row_ok[:, None], other=0.0).to(tl.float32)
            sn = tl.load(SIN + cd, mask=row_ok[:, None], other=0.0).to(tl.float32)
            a = (x * c).to(DT).to(tl.float32)
            bb = (xp * sign[None, :] * sn).to(DT).to(tl.float32)
        else:
            c = tl.load(COS + offs_d).to(tl.float32)
            sn = tl.load(SIN + offs_d).to(tl.float32)
            a = (x * c[None, :]).to(DT).to(tl.float32)
            bb = (xp * sign[None, :] * sn[None, :]).to(DT).to(tl.float32)
        x = a + bb
    return x.to(DT)


@triton.jit
def _block_scores(q, k, valid, m_i, l_i, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key block of the base-2 online softmax, its scores: q [GPAD, D] against keys
    [BLOCK_N, D] (`valid` ones) -> (new maxima, rescale of the old terms, weights, sums)."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GPAD, BLOCK_N] fp32
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    pr = tl.math.exp2(qk * qk_scale - m_new[:, None])
    return m_new, alpha, pr, l_i * alpha + tl.sum(pr, 1)


@triton.jit
def _block_values(pr, alpha, v, acc, DOT_PRECISION: tl.constexpr):
    """The block's values [BLOCK_N, D] weighted by `pr` into the rescaled accumulator."""
    return tl.dot(pr.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)


@triton.jit
def _decode_partial(
    Q, K, V, PT, LEN, Mx, Sm, Acc, Out, CNT, SLOTS, Kin, Vin, QN, KN, COS, SIN, PF,
    scale, trash, eps_q, eps_k, pf_words,
    s_qt, s_qh, s_kp, s_ks, s_kh, s_pt, s_mb, s_mh, s_ab, s_ah, s_as, s_ot, s_oh,
    s_kit, s_kih, s_vit, s_vih, s_cos,
    GROUP: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr,
    PS: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = 0,
    LAST_MERGES: tl.constexpr = False, WRITE_KV: tl.constexpr = False,
    QK_NORM: tl.constexpr = False, ROPE: tl.constexpr = False,
    DOT_PRECISION: tl.constexpr = None, PREFETCH: tl.constexpr = 0, CACHE: tl.constexpr = "",
):  # fmt: skip
    # Program (b, h, s): key blocks s, s + SPLITS, ... of row b (BLOCK_N keys each, gathered
    # from BLOCK_N / PS pages) for the query heads of kv head h; base-2 online softmax, so the
    # partial maxima are log2-scaled (as _merge_splits reads them). PDL: see launch.py.
    # LAST_MERGES: the last of the SPLITS programs of (b, h) to finish (a counter per (b, h)
    # in CNT, incremented with acquire-release semantics after the partial is stored) merges
    # the group's partials into Out and resets the counter to zero for the next launch, so no
    # second kernel is launched. Without it, _decode_merge does the merge.
    # WRITE_KV: the row's new key and value (Kin/Vin [B, Hkv, D]) are written to its slot
    # (SLOTS [B]; negative = the trash page, as write_kv does) by the one program whose key
    # blocks include the row's last position, before it reads them back (a CTA barrier
    # orders the stores before its loads; no other program reads that position), so the KV
    # write needs no launch of its own.
    # QK_NORM / ROPE (with WRITE_KV; Q, Kin and Vin then point into the q|k|v projection's
    # output): the query heads and the new key get their RMSNorm (weights QN / KN) and rotary
    # embedding (COS / SIN rows [B, D]) here, as _norm_rope rounds them, instead of in
    # separate kernels before the attention.
    # PREFETCH (1 first thing, 2 once the partial is stored): the programs ask L2 for the
    # int32 words PF[0:pf_words] between them (the next product's weight, which nothing
    # writes during a step), while the memory has little else to do (launch.py).
    # CACHE: the loads of Q, Kin and Vin (".cg" where other programs of the same launch wrote
    # them: attention_o's q|k|v phase).
    prog = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * SPLITS + tl.program_id(2)
    progs = tl.num_programs(0) * tl.num_programs(1) * SPLITS
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    offs_g = tl.arange(0, GPAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < GROUP
    if PREFETCH == 1:
        prefetch_l2(PF, pf_words, prog, progs, 128)
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    seqlen = tl.max(tl.load(LEN + b + tl.arange(0, 1)), 0)  # 0-d compiled and interpreted
    if WRITE_KV:  # noqa: SIM102 - a constexpr branch (pruned at compile time) around a runtime one
        if ((seqlen - 1) // BLOCK_N) % SPLITS == s:  # padding rows (seqlen 0) write the trash
            slot = tl.max(tl.load(SLOTS + b + tl.arange(0, 1)), 0)
            slot = tl.where(slot < 0, trash * PS, slot)
            dst = (slot // PS) * s_kp + (slot % PS) * s_ks + h * s_kh + offs_d
            if QK_NORM or ROPE:
                one = tl.arange(0, 1)
                kn = _norm_rope(Kin, b * s_kit + h * s_kih + one, one < 1, KN, eps_k,
                                COS + b * s_cos, SIN + b * s_cos, Kin.dtype.element_ty, D,
                                QK_NORM, ROPE, CACHE)  # fmt: skip
                kn = tl.reshape(kn, (D,))
            else:
                kn = tl.load(Kin + b * s_kit + h * s_kih + offs_d, cache_modifier=CACHE)
            vn = tl.load(Vin + b * s_vit + h * s_vih + offs_d, cache_modifier=CACHE)
            tl.store(K + dst, kn.to(K.dtype.element_ty))
            tl.store(V + dst, vn.to(V.dtype.element_ty))
            tl.debug_barrier()
    if QK_NORM or ROPE:
        q = _norm_rope(Q, b * s_qt + (h * GROUP + offs_g) * s_qh, gmask, QN, eps_q,
                       COS + b * s_cos, SIN + b * s_cos, Q.dtype.element_ty, D, QK_NORM, ROPE,
                       CACHE)  # fmt: skip
    else:
        q = tl.load(
            Q + b * s_qt + (h * GROUP + offs_g)[:, None] * s_qh + offs_d[None, :],
            mask=gmask[:, None], other=0.0, cache_modifier=CACHE,
        )  # fmt: skip
    qk_scale = scale * LOG2E
    m_i = tl.full([GPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GPAD], tl.float32)
    acc = tl.zeros([GPAD, D], tl.float32)
    num_blocks = tl.cdiv(seqlen, BLOCK_N)
    num_iters = tl.cdiv(tl.maximum(num_blocks - s, 0), SPLITS)
    for i in range(0, num_iters):
        kpos = (s + i * SPLITS) * BLOCK_N + offs_n
        valid = kpos < seqlen  # the block starts before seqlen: at least one key is valid
        page = tl.load(PT + b * s_pt + kpos // PS, mask=valid, other=-1)
        page = tl.where(page < 0, trash, page)
        kv = page * s_kp + (kpos % PS) * s_ks + h * s_kh
        k = tl.load(K + kv[:, None] + offs_d[None, :])
        m_i, alpha, pr, l_i = _block_scores(q, k, valid, m_i, l_i, qk_scale, DOT_PRECISION)
        v = tl.load(V + kv[:, None] + offs_d[None, :])
        acc = _block_values(pr, alpha, v, acc, DOT_PRECISION)
    if PDL == 3:
        tl.extra.cuda.gdc_launch_dependents()
    row = b * s_mb + (h * GROUP + offs_g) * s_mh + s
    tl.store(Mx + row, m_i, mask=gmask)
    tl.store(Sm + row, l_i, mask=gmask)
    arow = b * s_ab + (h * GROUP + offs_g) * s_ah + s * s_as
    tl.store(Acc + arow[:, None] + offs_d[None, :], acc, mask=gmask[:, None])
    if PREFETCH == 2:
        prefetch_l2(PF, pf_words, prog, progs, 128)
    if LAST_MERGES:
        counter = CNT + b * tl.num_programs(1) + h
        tl.debug_barrier()  # every thread's partial stores precede the release below
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:  # every partial is stored
            tl.debug_barrier()  # the acquire precedes every thread's loads
            for g in tl.static_range(GROUP):
                _merge_splits(Mx, Sm, Acc, Out, b, h * GROUP + g, s_mb, s_mh, s_ab, s_ah, s_as,
                              s_ot, s_oh, D, SPLITS)  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed")


@triton.jit
def _decode_merge(
    Mx, Sm, Acc, Out, s_mb, s_mh, s_ab, s_ah, s_as, s_ot, s_oh,
    D: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr = 0,
):  # fmt: skip
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:  # nothing to overlap: the merge is all of it
        tl.extra.cuda.gdc_launch_dependents()
    _merge_splits(Mx, Sm, Acc, Out, tl.program_id(0), tl.program_id(1), s_mb, s_mh, s_ab, s_ah,
                  s_as, s_ot, s_oh, D, SPLITS)  # fmt: skip


@torch.library.custom_op("flare::paged_decode_attention", mutates_args=(), tags=SHARED_STEP_INPUTS)
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """q [B, Hq, D], pages [N+1, PS, Hkv, D], page_table [B, P], seq_lens [B] -> [B, Hq, D]."""
    return _decode(q, k_cache, v_cache, page_table, seq_lens, scale, None)


@torch.library.custom_op(
    "flare::paged_decode_attention_writing",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def decode_attention_writing(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, slots: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """write_kv_triton(k_cache, v_cache, slots, key, value) then decode_attention, in one
    launch: key/value [B, Hkv, D] are each row's new token, at position seq_lens - 1."""
    return _decode(q, k_cache, v_cache, page_table, seq_lens, scale, (slots, key, value))


@torch.library.custom_op(
    "flare::paged_decode_attention_from_qkv",
    mutates_args=("k_cache", "v_cache"),
    tags=SHARED_STEP_INPUTS,
)
def decode_attention_from_qkv(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, slots: torch.Tensor, num_q_heads: int,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps_q: float, eps_k: float,
    cos: torch.Tensor, sin: torch.Tensor, prefetch: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """A decode step's attention straight from the q|k|v projection's output qkv
    [B, (Hq + 2 Hkv) * D]: the query heads and each row's new key get their RMSNorm
    (q_norm / k_norm weights [D], or none) and rotary embedding (cos / sin [B, D]), the new key
    and value are written to `slots`, and the rows attend: the canonical layer's split,
    q/k norms, rotary embedding, KV write and attention, in one launch. -> [B, Hq, D].
    `prefetch`: the weight of the product that runs next (the o projection's), which the
    launch warms in L2 where `launch.set_attention_prefetch` asks for it."""
    b = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    heads = qkv.view(b, -1, d)
    q, key, value = heads.split([num_q_heads, hkv, hkv], dim=1)
    norms = (q_norm, k_norm, eps_q, eps_k) if q_norm is not None and k_norm is not None else None
    rope = (norms, cos, sin)
    new = (slots, key, value)
    return _decode(q, k_cache, v_cache, page_table, seq_lens, scale, new, rope, prefetch)


def _decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
    seq_lens: torch.Tensor, scale: float,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    rope: tuple[tuple[torch.Tensor, torch.Tensor, float, float] | None, torch.Tensor,
                torch.Tensor] | None = None,
    prefetch: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    b, hq, d = q.shape
    ps, hkv = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the k and v pages must share one layout")
    group = hq // hkv
    splits = DECODE_SPLITS
    mx = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    sm = torch.empty_like(mx)
    acc = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    pdl = launch.pdl_mode(q.device)
    counters = merge_counters(q.device, b * hkv) if MERGE_IN_LAST_PROGRAM else None
    page_table, seq_lens = launch.unit_stride(page_table), launch.unit_stride(seq_lens)
    slots, key, value = new if new is not None else (seq_lens, q, q)  # unread without a write
    slots = launch.unit_stride(slots)
    if key.stride(-1) != 1 or value.stride(-1) != 1 or q.stride(-1) != 1:
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
    norms, cos, sin = rope if rope is not None else (None, q, q)  # unread without rope
    qn, kn, eps_q, eps_k = norms if norms is not None else (q, q, 0.0, 0.0)
    if rope is not None:
        cos, sin = launch.rotary_rows(cos, sin, b, d)
    words = launch.prefetch_words(prefetch)
    where = launch.attention_prefetch(q.device, words.numel() * 4) if words is not None else 0
    _decode_partial[(b, hkv, splits)](
        q, k_cache, v_cache, page_table, seq_lens, mx, sm, acc, out,
        counters if counters is not None else seq_lens, slots, key, value, qn, kn, cos, sin,
        words if where else seq_lens,
        scale, k_cache.shape[0] - 1, eps_q, eps_k, words.numel() if where else 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), mx.stride(0), mx.stride(1), acc.stride(0), acc.stride(1),
        acc.stride(2), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), cos.stride(0),
        GROUP=group, GPAD=max(16, triton.next_power_of_2(group)), D=d, PS=ps,
        BLOCK_N=decode_keys(ps), SPLITS=splits, PDL=pdl, LAST_MERGES=counters is not None,
        WRITE_KV=new is not None, QK_NORM=norms is not None, ROPE=rope is not None,
        DOT_PRECISION=launch.dot_precision(k_cache.dtype),
        PREFETCH=where, launch_pdl=pdl > 0,
        num_warps=DECODE_WARPS,
    )  # fmt: skip
    if counters is None:
        _decode_merge[(b, hq)](
            mx, sm, acc, out, mx.stride(0), mx.stride(1), acc.stride(0), acc.stride(1),
            acc.stride(2), out.stride(0), out.stride(1), D=d, SPLITS=splits,
            PDL=pdl, launch_pdl=pdl > 0,
        )  # fmt: skip
    return out


MERGE_IN_LAST_PROGRAM = True  # False: the separate merge launch (kept for comparison)


def merge_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The last-program merge's counters (`launch.zeroed_counters`); None while a capture is
    under way and they are too few: the caller then launches the separate merge kernel."""
    return launch.zeroed_counters("decode_attention", device, n)


# Opaque to torch.compile: the compiled forward calls the kernels, Inductor fuses around them.
@decode_attention.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, scale):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)  # contiguous, as _decode allocates it (whatever q's strides)


@decode_attention_writing.register_fake
def _(q, k_cache, v_cache, page_table, seq_lens, scale, slots, key, value):  # type: ignore[no-untyped-def]
    return q.new_empty(q.shape)


@decode_attention_from_qkv.register_fake
def _(qkv, k_cache, v_cache, page_table, seq_lens, scale, slots, num_q_heads, q_norm, k_norm,  # type: ignore[no-untyped-def]
      eps_q, eps_k, cos, sin, prefetch=None):  # fmt: skip
    return qkv.new_empty((qkv.shape[0], num_q_heads, k_cache.shape[3]))
