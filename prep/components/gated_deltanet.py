"""Gated DeltaNet token mixing over the state pool: the kernel-level half of a GDN layer.

The recipe's prepared module owns the model semantics (projections, the decay/learning-rate
formulas, the gated output norm) and hands this component the pre-convolution q|k|v channels,
the log-decay g and the learning rate beta. This component runs the causal depthwise
convolution and the gated delta rule against the pool rows named by explicit metadata:

    state_rows [B] int64  pool row of each batch request (decode: B == T, one token each;
                          prefill: B == 1, T tokens); NULL_ROW = read the null state, write nothing
    num_valid  [1] int64  prefill: the chunk's leading real tokens (the rest is padding)

State per layer (declared by `state_tensors`, allocated by the pool):
    recurrent [Hv, Dv, Dk] fp32       S^T, key dimension last: the layout FlashInfer's GDN
                                      kernels and flash-linear-attention's serving ops index
                                      by state row, so a CUDA backend reads the pool as is
    conv      [C, K-1] execution dtype the last K-1 pre-convolution inputs, oldest first

Update rule per token (matching Transformers' torch fallback): q, k are L2-normalised and q is
scaled by Dk^-1/2; S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q. Prefill uses the
chunked (UT-transform) form with 64-token chunks, decode the per-token recurrence; padded
prefill tokens get g = 0, beta = 0, which leaves S exactly unchanged.

The PyTorch reference runs everywhere. On CUDA the runner binds `gdn_triton.TritonGDN`
(`RecurrentMeta.backend`): Flare's Triton decode kernel updating pool rows in place, and
flash-linear-attention's chunked kernel for prefill. FlashInfer's GDN kernels
(`gdn_decode.gated_delta_rule_decode_pretranspose`, `gdn_prefill.chunk_gated_delta_rule`, fp32
K-last pool with state indices) fit the same contract; its SM90 prefill needs the CUTLASS DSL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from prep.bundle import StateTensor
from prep.components.state_pool import NULL_ROW, StatePool, scatter_rows

CHUNK_TOKENS = 64
L2_EPS = 1e-6


@dataclass(frozen=True)
class GDNShape:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


def state_tensors(layer: int, shape: GDNShape) -> list[StateTensor]:
    """The per-row state one GDN layer declares in the bundle manifest."""
    return [
        StateTensor(layer, "recurrent", [shape.num_v_heads, shape.head_v_dim, shape.head_k_dim]),
        StateTensor(layer, "conv", [shape.conv_dim, shape.conv_kernel - 1], dtype="execution"),
    ]


@dataclass
class RecurrentMeta:
    mode: str  # "prefill" | "decode"
    state_rows: torch.Tensor
    num_valid: torch.Tensor
    pool: StatePool
    backend: Any = None


class GDNBackend(Protocol):
    def mix(
        self,
        meta: RecurrentMeta,
        states: dict[str, torch.Tensor],
        shape: GDNShape,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor: ...


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked. q, k: [T, H, Dk]; v: [T, H, Dv]; g, beta: [T, H]; state
    [H, Dk, Dv] -> (o [T, H, Dv] fp32, final state [H, Dk, Dv] fp32). q, k are unnormalised."""
    t = q.shape[0]
    q, k, v, g, beta = (x.transpose(0, 1).float() for x in (q, k, v, g, beta))  # [H, T, ...]
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    h, n = q.shape[0], (t + pad) // chunk
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(h, n, chunk).cumsum(-1)  # [H, N, c] log decay from the chunk start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay  # [H, N, c, c] unit lower triangular system
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(
        ut, k_beta * cum.exp()[..., None], upper=False, unitriangular=True
    )
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, N, 1, 1]
    s = state.float()
    outs = []
    for i in range(n):  # static: the chunk count is fixed by the capacity
        v_i = new_v[:, i] - k_cum[:, i] @ s
        outs.append(q[:, i] @ s + intra[:, i] @ v_i)
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_i
    o = torch.stack(outs, dim=1).reshape(h, n * chunk, -1)[:, :t]
    return o.transpose(0, 1), s


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per batch row. q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H];
    state [B, H, Dk, Dv] -> (o [B, H, Dv] fp32, new state [B, H, Dk, Dv] fp32)."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    s = state.float() * g.float().exp()[..., None, None]
    kv_mem = (s * k[..., None]).sum(-2)  # [B, H, Dv]
    delta = (v.float() - kv_mem) * beta.float()[..., None]
    s = s + k[..., None] * delta[..., None, :]
    return (s * q[..., None]).sum(-2), s


class ReferenceGDN:
    """The PyTorch reference of the `mix` contract (CPU, and CUDA until a kernel is bound)."""

    def mix(
        self,
        meta: RecurrentMeta,
        states: dict[str, torch.Tensor],
        shape: GDNShape,
        mixed_qkv: torch.Tensor,
        conv_weight: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """mixed_qkv: [T, C] pre-convolution q|k|v; conv_weight [C, K]; g, beta [T, Hv]
        -> o [T, Hv, Dv] in mixed_qkv's dtype. `states`: this layer's pool tensors
        ("recurrent", "conv"); reads and writes the rows `meta` names."""
        st = states
        rows = meta.state_rows
        s0 = st["recurrent"].index_select(0, rows).transpose(-1, -2)  # [B, Hv, Dk, Dv]
        if meta.mode == "decode":
            x, hist = self._conv_decode(mixed_qkv, st["conv"].index_select(0, rows), conv_weight)
            q, k, v = _split_heads(x, shape)
            o, s = recurrent_gated_delta_rule(q, k, v, g, beta, s0)
        else:
            t = mixed_qkv.shape[0]
            valid = torch.arange(t, device=g.device) < meta.num_valid  # [T]
            x, hist = self._conv_prefill(
                mixed_qkv, st["conv"].index_select(0, rows)[0], conv_weight, meta.num_valid
            )
            q, k, v = _split_heads(x, shape)
            g = torch.where(valid[:, None], g, 0.0)  # padding: S unchanged (decay 1, no write)
            beta = torch.where(valid[:, None], beta, 0.0)
            o, s1 = chunk_gated_delta_rule(q, k, v, g, beta, s0[0])
            s, hist = s1[None], hist[None]
        scatter_rows(st["recurrent"], rows, s.transpose(-1, -2))
        scatter_rows(st["conv"], rows, hist)
        return o.to(mixed_qkv.dtype)

    @staticmethod
    def _conv_prefill(
        x: torch.Tensor, hist: torch.Tensor, weight: torch.Tensor, num_valid: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, C]; hist: [C, K-1]; weight [C, K] -> (silu(conv) [T, C], new hist [C, K-1]).
        # The depthwise causal filter as K shifted multiply-adds over the rows of [K-1+T, C]:
        # one elementwise kernel under the compiler, and the output rows stay contiguous for
        # the q/k/v split (a grouped conv1d runs channels-first and needs two transposes).
        t, kernel = x.shape[0], weight.shape[1]
        full = torch.cat([hist.transpose(0, 1).to(x.dtype), x], dim=0)  # [K-1+T, C]
        w = weight.transpose(0, 1)  # [K, C]
        acc = full[0:t].to(w.dtype) * w[0]
        for j in range(1, kernel):
            acc = acc + full[j : j + t].to(w.dtype) * w[j]
        y = F.silu(acc).to(x.dtype)
        # the last K-1 real inputs sit at full[num_valid : num_valid + K-1]
        idx = num_valid + torch.arange(kernel - 1, device=x.device)
        return y, full.index_select(0, idx).transpose(0, 1)

    @staticmethod
    def _conv_decode(
        x: torch.Tensor, hist: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, C]; hist: [B, C, K-1]; weight [C, K] -> ([B, C], new hist [B, C, K-1])
        full = torch.cat([hist.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
        y = F.silu((full.to(weight.dtype) * weight[None]).sum(-1)).to(x.dtype)
        return y, full[:, :, 1:]


def _split_heads(
    x: torch.Tensor, shape: GDNShape
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # x: [T, C] -> q, k [T, Hv, Dk] (key heads repeated per value group), v [T, Hv, Dv]
    q, k, v = torch.split(x, [shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
    t, rep = x.shape[0], shape.num_v_heads // shape.num_k_heads
    q = q.reshape(t, shape.num_k_heads, shape.head_k_dim)
    k = k.reshape(t, shape.num_k_heads, shape.head_k_dim)
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    return q, k, v.reshape(t, shape.num_v_heads, shape.head_v_dim)


REFERENCE = ReferenceGDN()


def mix(
    meta: RecurrentMeta,
    states: dict[str, torch.Tensor],
    shape: GDNShape,
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    backend: GDNBackend = meta.backend if meta.backend is not None else REFERENCE
    return backend.mix(meta, states, shape, mixed_qkv, conv_weight, g, beta)


__all__ = ["NULL_ROW", "GDNShape", "RecurrentMeta", "mix", "state_tensors"]
