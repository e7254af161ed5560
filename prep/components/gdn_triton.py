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

The causal convolution stays in PyTorch in both modes (a depthwise K-tap filter: Inductor fuses
it into the neighbouring elementwise work when the forward is compiled).

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

from prep.components import gated_deltanet as gdn
from prep.components.state_pool import NULL_ROW, scatter_rows

log = logging.getLogger("prep.gdn")

BLOCK_V = 32


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


@torch.library.custom_op("flare::gdn_decode", mutates_args=("state",))
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
    x, g, beta = x.contiguous(), g.contiguous(), beta.contiguous()
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
        x, hist = gdn.ReferenceGDN._conv_prefill(
            mixed_qkv, conv.index_select(0, rows)[0], conv_weight, meta.num_valid
        )
        valid = (torch.arange(t, device=g.device) < meta.num_valid)[:, None]  # [T, 1]
        g = torch.where(valid, g, 0.0).float()
        beta = torch.where(valid, beta, 0.0).float()
        hk, dk = shape.num_k_heads, shape.head_k_dim
        q, k, v = torch.split(x, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        # q and k L2-normalised and v made contiguous here, where the compiler writes them
        # straight from the convolution's fused kernel: flash-linear-attention's in-kernel
        # normalisation is two more launches per layer (the same fp32 x / sqrt(sum x^2 + 1e-6),
        # rounded to the input dtype), and a strided input a copy inside the opaque call
        q = gdn.l2norm(q.reshape(t, hk, dk).float()).to(x.dtype)
        k = gdn.l2norm(k.reshape(t, hk, dk).float()).to(x.dtype)
        s0 = recurrent.index_select(0, rows)  # [1, Hv, Dv, Dk] fp32
        o, s1 = gdn_chunk(
            q, k, v.reshape(t, shape.num_v_heads, shape.head_v_dim).contiguous(), g, beta, s0
        )
        scatter_rows(recurrent, rows, s1)
        scatter_rows(conv, rows, hist[None].contiguous())  # contiguous: one launch, no copy
        return o


__all__ = ["TritonGDN", "gdn_chunk", "gdn_decode"]
