"""Gated DeltaNet on CUDA: the `mix` contract of `gated_deltanet` with GPU kernels.

Decode (one token per batch row) is Flare's own Triton kernel: it reads each row's recurrent
state straight from its pool row, applies one step of the gated delta rule and writes the state
back in place. Nothing is gathered or scattered around it, so a decode step moves each live
row's state once in and once out (the reference moves it five times). Padding rows
(NULL_ROW) read the null state and store nothing.

Prefill (one request, one chunk of T tokens) runs flash-linear-attention's chunked Triton
kernel (`chunk_gated_delta_rule`, state V-first like the pool) on the gathered state row; the
final state is scattered back with `scatter_rows`. Without that package installed, prefill
falls back to the PyTorch reference (correct, slow) and says so once in the log.

The causal convolution of a prefill chunk can be one Triton launch too (`gdn_conv_prefill`):
the depthwise K-tap filter, SiLU and the per-head L2 norms of q and k, writing q, k and v
contiguous for the chunk kernel and the carried history for the pool. Under Inductor the same
work is a convolution kernel reading strided rows plus two norm kernels per layer (on the H200,
a 9B-shape layer's convolution alone took 24 µs at 384 tokens; the kernel takes 12.7 µs).
It is **on** (`CONV_KERNEL`): alone, eagerly or on the H200, it equals the PyTorch path
(bf16 and fp32, strided rows, partial chunks), and a whole bf16 hybrid through the runner's CUDA
graphs matches Transformers with it as closely as without it (tests/gpu/test_gpu_hybrid.py runs
both; an early drift with it came from the runner switching streams around every step, since
removed). `conv_prefill_unfused` is the same contract as PyTorch ops, compiled with its
neighbours, where the kernel does not fit or fails to build. Decode's convolution (one token per row)
stays in PyTorch, fused by the compiler into its neighbours.

Kernel contract (decode), per batch row b and value head h, key head hk = h // (Hv / Hk):

    x      [B, C]             post-convolution q | k | v channels (C = 2 Hk Dk + Hv Dv)
    g      [B, Hv] fp32       log decay; beta [B, Hv] learning rate (any float dtype)
    rows   [B] int64          pool row per batch row; NULL_ROW = read null state, store nothing
    state  [R, Hv, Dv, Dk]    fp32 pool tensor of this layer, updated in place
    o      [B, Hv, Dv]        output, x's dtype

    q = l2norm(q) Dk^-1/2, k = l2norm(k);  S <- exp(g) S;  S <- S + beta (v - S k) k^T;  o = S q

Grid: (B * Hv, Dv / BLOCK_V). Each program owns a [BLOCK_V, Dk] slab of one row's state, so
no two programs touch the same state elements and the in-place update needs no atomics.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from prep.components import SHARED_STEP_INPUTS
from prep.components import gated_deltanet as gdn
from prep.components.state_pool import NULL_ROW, scatter_rows

log = logging.getLogger("prep.gdn")

BLOCK_V = 32

# Whether TritonGDN's prefill runs `gdn_conv_prefill` where it fits (see the module docstring).
CONV_KERNEL = True


@triton.jit
def _gdn_decode_kernel(
    X, G, BETA, ROWS, STATE, OUT,
    s_xb, s_gb, s_bb, s_sr, s_ob, scale,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_V: tl.constexpr, NULL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    b = pid // HV
    h = pid % HV
    hk = h // (HV // HK)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, DK)
    row = tl.load(ROWS + b)
    xb = X + b * s_xb
    q = tl.load(xb + hk * DK + offs_k).to(tl.float32)
    k = tl.load(xb + HK * DK + hk * DK + offs_k).to(tl.float32)
    v = tl.load(xb + 2 * HK * DK + h * DV + offs_v).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
    decay = tl.exp(tl.load(G + b * s_gb + h).to(tl.float32))
    beta = tl.load(BETA + b * s_bb + h).to(tl.float32)
    # S^T slab: [BLOCK_V, DK], key dimension contiguous (the pool's V-first layout)
    p_s = STATE + row * s_sr + h * DV * DK + offs_v[:, None] * DK + offs_k[None, :]
    s = tl.load(p_s) * decay
    delta = (v - tl.sum(s * k[None, :], 1)) * beta  # [BLOCK_V]
    s = s + delta[:, None] * k[None, :]
    o = tl.sum(s * q[None, :], 1)
    tl.store(OUT + b * s_ob + h * DV + offs_v, o.to(OUT.dtype.element_ty))
    if row != NULL:
        tl.store(p_s, s)


@torch.library.custom_op("flare::gdn_decode", mutates_args=("state",), tags=SHARED_STEP_INPUTS)
def gdn_decode(
    x: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: torch.Tensor,
    state: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
) -> torch.Tensor:
    """One gated-delta-rule step per row, in place on `state` (see the module docstring).

    Opaque on purpose, like `flare::write_kv`: traced as indexing on a graph input, the
    compiler would copy the whole pool per layer per step."""
    b, c = x.shape
    _, hv, dv, dk = state.shape
    if dk != head_k_dim or c != 2 * num_k_heads * head_k_dim + hv * dv:
        raise ValueError(f"gdn_decode: x {tuple(x.shape)} does not match state {state.shape}")
    if dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"gdn_decode needs power-of-two head dims, got Dk={dk}, Dv={dv}")
    block_v = min(BLOCK_V, dv)
    x, g, beta, rows = x.contiguous(), g.contiguous(), beta.contiguous(), rows.contiguous()
    out = torch.empty((b, hv, dv), dtype=x.dtype, device=x.device)
    _gdn_decode_kernel[(b * hv, dv // block_v)](
        x, g, beta, rows, state, out,
        x.stride(0), g.stride(0), beta.stride(0), state.stride(0), out.stride(0), dk**-0.5,
        HK=num_k_heads, HV=hv, DK=dk, DV=dv, BLOCK_V=block_v, NULL=NULL_ROW,
    )  # fmt: skip
    return out


@gdn_decode.register_fake
def _(x, g, beta, rows, state, num_k_heads, head_k_dim):  # type: ignore[no-untyped-def]
    return x.new_empty((x.shape[0], state.shape[1], state.shape[2]))


@triton.jit
def _conv_prefill_kernel(
    X, HIST, W, NUM_VALID, Q, K, V, NEW_HIST,
    T, s_xt, s_hc, s_wc, key_dim, eps,
    KERNEL: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    c0 = tl.program_id(1) * D
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    offs_c = c0 + offs_d
    in_t = offs_t < T
    acc = tl.zeros((BLOCK_T, D), dtype=tl.float32)
    for j in tl.static_range(KERNEL):
        # row offs_t + j of [history (K-1 rows) | x]: x row offs_t + j - (K-1), or history
        src = offs_t + j - (KERNEL - 1)
        from_x = (src >= 0) & in_t
        from_h = (src < 0) & in_t
        xv = tl.load(X + src[:, None] * s_xt + offs_c[None, :], mask=from_x[:, None], other=0.0)
        hv = tl.load(
            HIST + offs_c[None, :] * s_hc + (offs_t + j)[:, None], mask=from_h[:, None], other=0.0
        )
        w = tl.load(W + offs_c * s_wc + j).to(tl.float32)
        acc += (xv.to(tl.float32) + hv.to(X.dtype.element_ty).to(tl.float32)) * w[None, :]
    y = (acc * tl.sigmoid(acc)).to(X.dtype.element_ty)  # silu, rounded as the unfused path
    if c0 < 2 * key_dim:  # a q or k head: L2-normalised over its D channels
        yf = y.to(tl.float32)
        y = (yf * tl.rsqrt(tl.sum(yf * yf, axis=1) + eps)[:, None]).to(X.dtype.element_ty)
    if c0 < key_dim:
        tl.store(Q + offs_t[:, None] * key_dim + offs_c[None, :], y, mask=in_t[:, None])
    elif c0 < 2 * key_dim:
        tl.store(K + offs_t[:, None] * key_dim + (offs_c - key_dim)[None, :], y, mask=in_t[:, None])
    else:
        value_dim = tl.num_programs(1) * D - 2 * key_dim
        tl.store(
            V + offs_t[:, None] * value_dim + (offs_c - 2 * key_dim)[None, :], y,
            mask=in_t[:, None],
        )  # fmt: skip
    if pid_t == 0:  # the last K-1 real inputs: rows num_valid .. num_valid + K-2 of the above
        n = tl.load(NUM_VALID)
        for j in tl.static_range(KERNEL - 1):
            at = n + j - (KERNEL - 1) + offs_d * 0  # one row, as a vector for the masks
            hx = tl.load(X + at * s_xt + offs_c, mask=at >= 0, other=0.0)
            hh = tl.load(HIST + offs_c * s_hc + n + j, mask=at < 0, other=0.0)
            val = tl.where(at >= 0, hx, hh.to(X.dtype.element_ty))
            tl.store(NEW_HIST + offs_c * (KERNEL - 1) + j, val)


def conv_prefill_fits(shape: gdn.GDNShape) -> bool:
    """Whether `gdn_conv_prefill` covers the shape: one power-of-two head width for q, k and v
    channel blocks (every released Gated DeltaNet model)."""
    d = shape.head_k_dim
    return d & (d - 1) == 0 and 16 <= d <= 256 and shape.value_dim % d == 0


def conv_prefill_unfused(
    x: torch.Tensor,
    hist: torch.Tensor,
    weight: torch.Tensor,
    num_valid: torch.Tensor,
    key_dim: int,
    head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gdn_conv_prefill`'s contract in PyTorch ops (fp32 sums as the kernel): what runs where
    its kernel cannot (see `_ConvKernel`)."""
    t = x.shape[0]
    y, new_hist = gdn.ReferenceGDN._conv_prefill(
        x.float(), hist.to(x.dtype).float(), weight.float(), num_valid
    )
    y = y.to(x.dtype)
    q, k, v = torch.split(y, [key_dim, key_dim, y.shape[1] - 2 * key_dim], dim=-1)

    def norm(a: torch.Tensor) -> torch.Tensor:
        return gdn.l2norm(a.reshape(t, -1, head_k_dim).float()).to(x.dtype).reshape(t, key_dim)

    return norm(q), norm(k), v.contiguous(), new_hist.to(x.dtype).contiguous()


class _ConvKernel:
    """Whether `_conv_prefill_kernel` failed to compile or launch here: `gdn_conv_prefill` then
    says so once and computes the same contract with PyTorch ops for good. The first call
    happens while the runner warms its executions, before any graph capture (as RowCopier)."""

    failed = False


@torch.library.custom_op("flare::gdn_conv_prefill", mutates_args=())
def gdn_conv_prefill(
    x: torch.Tensor,
    hist: torch.Tensor,
    weight: torch.Tensor,
    num_valid: torch.Tensor,
    key_dim: int,
    head_k_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The causal depthwise convolution of one prefill chunk, SiLU, and the L2 normalisation of
    q and k per head, in one launch, writing q, k and v contiguous for the chunk kernel.

    x [T, C] (q | k | v channels, rows may be strided); hist [C, K-1] the previous K-1 inputs;
    weight [C, K]; num_valid [1] int -> (q [T, key_dim], k [T, key_dim], v [T, C - 2 key_dim],
    new hist [C, K-1]: the last K-1 of the num_valid real inputs), all in x's dtype. The same
    arithmetic as `ReferenceGDN._conv_prefill` + `l2norm` under the compiler: fp32 sums, the
    SiLU output rounded to x's dtype before the norm."""
    t, c = x.shape
    kernel = weight.shape[1]
    if c % head_k_dim or key_dim % head_k_dim:
        raise ValueError(f"gdn_conv_prefill: {c} channels are not whole {head_k_dim}-wide heads")
    if _ConvKernel.failed:
        return conv_prefill_unfused(x, hist, weight, num_valid, key_dim, head_k_dim)
    # rows may be strided (a fused projection's slice); channels and taps must be unit-stride
    x = x if x.stride(1) == 1 else x.contiguous()
    hist = hist if hist.stride(1) == 1 else hist.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    q = x.new_empty((t, key_dim))
    k = x.new_empty((t, key_dim))
    v = x.new_empty((t, c - 2 * key_dim))
    new_hist = x.new_empty((c, kernel - 1))
    block_t = 16
    try:
        _conv_prefill_kernel[(triton.cdiv(t, block_t), c // head_k_dim)](
            x, hist, weight, num_valid, q, k, v, new_hist,
            t, x.stride(0), hist.stride(0), weight.stride(0), key_dim, gdn.L2_EPS,
            KERNEL=kernel, D=head_k_dim, BLOCK_T=block_t,
        )  # fmt: skip
    except Exception:  # compile or launch failure: the PyTorch ops compute the same
        log.exception("one-launch GDN convolution unavailable; running it as PyTorch ops")
        _ConvKernel.failed = True
        return conv_prefill_unfused(x, hist, weight, num_valid, key_dim, head_k_dim)
    return q, k, v, new_hist


@gdn_conv_prefill.register_fake
def _(x, hist, weight, num_valid, key_dim, head_k_dim):  # type: ignore[no-untyped-def]
    t, c = x.shape
    return (
        x.new_empty((t, key_dim)), x.new_empty((t, key_dim)), x.new_empty((t, c - 2 * key_dim)),
        x.new_empty((c, weight.shape[1] - 1)),
    )  # fmt: skip


def _chunk_kernel() -> Any:
    """flash-linear-attention's chunked GDN, or None where the package is missing."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


@torch.library.custom_op("flare::gdn_chunk", mutates_args=())
def gdn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence through flash-linear-attention's chunked kernel, opaque to the compiler.

    q, k [T, Hk, Dk] (L2-normalised); v [T, Hv, Dv]; g, beta [T, Hv] fp32; state
    [1, Hv, Dv, Dk] fp32 -> (o [T, Hv, Dv] in v's dtype, final state [1, Hv, Dv, Dk] fp32)."""
    o, s1 = _chunk_kernel()(
        q[None], k[None], v[None], g[None], beta[None], scale=q.shape[-1] ** -0.5,
        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=False,
        state_v_first=True,
    )  # fmt: skip
    return o[0].to(v.dtype), s1.float()


@gdn_chunk.register_fake
def _(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    return v.new_empty(v.shape), state.new_empty(state.shape)


class TritonGDN:
    """The `GDNBackend` for CUDA (see the module docstring)."""

    def __init__(self) -> None:
        self._chunk = _chunk_kernel()
        if self._chunk is None:
            log.warning(
                "flash-linear-attention is not installed: GDN prefill chunks run the PyTorch "
                "reference (install the 'cuda' extra for the chunked kernel)"
            )

    def mix(
        self,
        meta: gdn.RecurrentMeta,
        states: dict[str, torch.Tensor],
        shape: gdn.GDNShape,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """mixed_qkv [T, C]; conv_weight [C, K]; g, beta [T, Hv] -> o [T, Hv, Dv]."""
        if meta.mode != "decode" and self._chunk is None:
            return gdn.REFERENCE.mix(meta, states, shape, mixed_qkv, conv_weight, g, beta)
        st = states
        rows = meta.state_rows
        conv, recurrent = st["conv"], st["recurrent"]
        if meta.mode == "decode":  # one token per row; the kernel updates rows in place
            x, hist = gdn.ReferenceGDN._conv_decode(
                mixed_qkv, conv.index_select(0, rows), conv_weight
            )
            scatter_rows(conv, rows, hist.contiguous())  # contiguous: one launch, no copy
            return gdn_decode(x, g, beta, rows, recurrent, shape.num_k_heads, shape.head_k_dim)
        # prefill, one request: rows [1]; padding tokens (>= num_valid) get g = beta = 0, which
        # leaves the state exactly unchanged
        t = mixed_qkv.shape[0]
        valid = (torch.arange(t, device=g.device) < meta.num_valid)[:, None]  # [T, 1]
        g = torch.where(valid, g, 0.0).float()
        beta = torch.where(valid, beta, 0.0).float()
        hk, dk = shape.num_k_heads, shape.head_k_dim
        # convolution, SiLU and the q/k L2 norms (flash-linear-attention's in-kernel
        # normalisation would be two more launches per layer), q/k/v written contiguous (a
        # strided input is a copy inside the opaque chunk call): compiled PyTorch ops, or one
        # launch where enabled and it fits (the same arithmetic)
        conv_in = (mixed_qkv, conv.index_select(0, rows)[0], conv_weight, meta.num_valid)
        if CONV_KERNEL and conv_prefill_fits(shape):
            q, k, v, hist = gdn_conv_prefill(*conv_in, shape.key_dim, dk)
        else:
            q, k, v, hist = conv_prefill_unfused(*conv_in, shape.key_dim, dk)
        q, k = q.view(t, hk, dk), k.view(t, hk, dk)
        s0 = recurrent.index_select(0, rows)  # [1, Hv, Dv, Dk] fp32
        o, s1 = gdn_chunk(q, k, v.view(t, shape.num_v_heads, shape.head_v_dim), g, beta, s0)
        scatter_rows(recurrent, rows, s1)
        scatter_rows(conv, rows, hist[None].contiguous())  # contiguous: one launch, no copy
        return o


__all__ = ["TritonGDN", "gdn_chunk", "gdn_conv_prefill", "gdn_decode"]
