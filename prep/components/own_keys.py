"""A prompt's first chunk, for the causal attention over its own keys (prefill{C}_fresh):
its query, key and value heads from the q|k|v projection's output in one launch, normalised and
rotated as the canonical modules round them, the keys and values also written to their pages
(triton_attention.prefill_attention_own_keys_from_qkv runs the attention over them)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prep.components import launch
from prep.components.triton_decode import _norm_rope


@triton.jit
def _own_keys_kernel(
    SLOTS, QKV, K, V, Qout, Kout, Vout, QN, KN, COS, SIN, eps_q, eps_k, trash_slot, T,
    s_t, s_kp, s_ks, s_kch, s_vp, s_vs, s_vch, s_cos,
    HQ: tl.constexpr, HQPAD: tl.constexpr, HKV: tl.constexpr, HKVPAD: tl.constexpr,
    PS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, NORM: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    # program: BLOCK_T tokens of the q|k|v output QKV (rows of (HQ + 2 HKV) heads of D): the
    # query heads normalised (weight QN) and rotated (COS / SIN rows [T, D]) into Qout
    # [T, HQ, D]; the key heads likewise (KN) into Kout [T, HKV, D] and into their page slots
    # (SLOTS, negative: the trash slot); the value heads copied into Vout and their slots. Each
    # head is read once; the rounding is _norm_rope's (_write_kv_kernel's pages, bit for bit).
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL:
        tl.extra.cuda.gdc_wait()
    if PDL >= 2:
        tl.extra.cuda.gdc_launch_dependents()
    DT = QKV.dtype.element_ty
    offs_d = tl.arange(0, D)
    r = tl.arange(0, BLOCK_T * HQPAD)
    qt = tl.program_id(0) * BLOCK_T + r // HQPAD
    qh = r % HQPAD
    q_ok = (qt < T) & (qh < HQ)
    q = _norm_rope(QKV, qt * s_t + qh * D, q_ok, QN, eps_q, COS, SIN, DT, D, NORM, True, "",
                   qt * s_cos, True)  # fmt: skip
    tl.store(Qout + (qt * HQ + qh)[:, None] * D + offs_d[None, :], q, mask=q_ok[:, None])
    r = tl.arange(0, BLOCK_T * HKVPAD)
    kt = tl.program_id(0) * BLOCK_T + r // HKVPAD
    kh = r % HKVPAD
    k_ok = (kt < T) & (kh < HKV)
    k = _norm_rope(QKV, kt * s_t + (HQ + kh) * D, k_ok, KN, eps_k, COS, SIN, DT, D, NORM, True, "",
                   kt * s_cos, True)  # fmt: skip
    v = tl.load(QKV + (kt * s_t + (HQ + HKV + kh) * D)[:, None] + offs_d[None, :],
                mask=k_ok[:, None], other=0.0)  # fmt: skip
    own = (kt * HKV + kh)[:, None] * D + offs_d[None, :]
    tl.store(Kout + own, k, mask=k_ok[:, None])
    tl.store(Vout + own, v, mask=k_ok[:, None])
    slot = tl.load(SLOTS + kt, mask=kt < T, other=-1)
    slot = tl.where(slot < 0, trash_slot, slot)
    page, off = slot // PS, slot % PS
    tl.store(K + (page * s_kp + off * s_ks + kh * s_kch)[:, None] + offs_d[None, :],
             k.to(K.dtype.element_ty), mask=k_ok[:, None])  # fmt: skip
    tl.store(V + (page * s_vp + off * s_vs + kh * s_vch)[:, None] + offs_d[None, :],
             v.to(V.dtype.element_ty), mask=k_ok[:, None])  # fmt: skip


def own_keys_heads(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    num_q_heads: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
    eps_q: float, eps_k: float, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """A chunk's q|k|v output qkv [T, (Hq + 2 Hkv) * D] -> its query, key and value heads,
    each contiguous ([T, Hq, D], [T, Hkv, D] twice): queries and keys normalised (q_norm /
    k_norm, or neither) and rotated (cos / sin [T, D]) as the canonical modules round them,
    and the keys and values written to their page slots (negative slots to the trash page),
    the pages bit for bit those of prefill_attention_from_qkv's KV write. One launch."""
    t = qkv.shape[0]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q and k norms come together or not at all")
    if qkv.shape[1] != (num_q_heads + 2 * hkv) * d:
        raise ValueError(
            f"q|k|v rows of {qkv.shape[1]} values do not hold {num_q_heads} + 2 x {hkv} heads of {d}"
        )
    qkv, slots = launch.unit_stride(qkv), launch.unit_stride(slots)
    cos, sin = launch.rotary_rows(cos, sin, t, d)
    q = qkv.new_empty((t, num_q_heads, d))
    k, v = qkv.new_empty((t, hkv, d)), qkv.new_empty((t, hkv, d))
    if t == 0:
        return q, k, v
    hqpad = triton.next_power_of_2(num_q_heads)
    block_t = launch.write_tokens_per_program(hqpad, d)
    pdl = launch.pdl_mode(qkv.device)
    norm = q_norm is not None
    ps = k_cache.shape[1]
    _own_keys_kernel[(triton.cdiv(t, block_t),)](
        slots, qkv, k_cache, v_cache, q, k, v, q_norm if norm else qkv, k_norm if norm else qkv,
        cos, sin, eps_q, eps_k, (k_cache.shape[0] - 1) * ps, t, qkv.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.stride(0),
        HQ=num_q_heads, HQPAD=hqpad, HKV=hkv, HKVPAD=triton.next_power_of_2(hkv), PS=ps, D=d,
        BLOCK_T=block_t, NORM=norm, PDL=pdl, launch_pdl=pdl > 0,
    )  # fmt: skip
    return q, k, v
