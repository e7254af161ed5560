"""Prepared attention and MLP blocks of the dense decoders, over fused projection weights.

They reproduce the canonical Llama/Qwen2/Qwen3/Mistral blocks operation for operation (the
parity tests against the unmodified Transformers model pin this), with two changes of layout
only: q/k/v are one projection (`qkv_proj`) and gate/up are one (`gate_up_proj`). Everything
else is the canonical module's own parts: its q/k norms, o_proj, activation, the modeling
module's `apply_rotary_pos_emb`, and the attention implementation selected in the config (the
paged one).

Fused decode layers (`decode_gemm="fused"`, opt-in): a decode step is bound by its weight
streams and, around them, by ~10 small kernels per layer. The canonical layer's two RMS norms,
SiLU * up and two residual adds can run inside the skinny products instead
(flare::skinny_fused): norm1 in q|k|v, the residual add in o, norm2 in gate|up, SiLU * up and
the residual add in down. Layers that qualify (`_fusable`) get a forward that takes that path
for decode-sized inputs; off CUDA the op runs the canonical operations, so the CPU parity tests
pin the dataflow, and Triton's interpreter pins the kernel. Measured 2.4x slower on the H200:
a prologue that transforms x inside the K loop stalls the weight stream.

Folded decode layers (`decode_gemm="folded"`, opt-in; faster at batch 1 only, H100: 8B shape
6.01 against 6.18 ms at c1, 6.48 against 6.20 at c2; 1.7B 2.04 against 2.13 at c1;
`decode_folded_rows` bounds the steps that run them): the same
four launches, but every product keeps the plain K loop. Each norm's weight is folded into the
columns of the projection it feeds (1/rms comes from a pass over x before the loop and scales
the accumulator after it), and gate|up's rows are interleaved so SiLU(gate) * up is the
epilogue of the gate|up product; down and o add the residual in their epilogues. The folding
rewrites the weights once, in place, at load (`_set_decode`); prefill chunks run the canonical
layer over the same weights (norms of weight one, gate and up split from interleaved columns).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from prep.bundle import Layout
from prep.components.fused import fuse_linears, prepare_linears

try:  # Triton comes with CUDA torch; without it decode layers stay unfused
    from prep.components.skinny_gemm import (
        MAX_ROWS,
        fold_norm,
        interleave_pairs,
        skinny_folded,
        skinny_fused,
    )
    from prep.components.skinny_mlp import skinny_mlp
except ImportError:  # pragma: no cover - depends on the install
    MAX_ROWS, skinny_fused, skinny_folded, skinny_mlp = 16, None, None, None


class FusedQKVAttention(nn.Module):
    """`output_gate`: the Gated DeltaNet hybrids' attention, whose q_proj rows interleave per
    head [query (head_dim) | gate (head_dim)], and whose output is scaled by sigmoid(gate)
    before o_proj (Qwen3-Next, Qwen3.5)."""

    def __init__(self, canonical: nn.Module, output_gate: bool = False) -> None:
        super().__init__()
        c: Any = canonical
        self.config = c.config
        self.layer_idx = c.layer_idx
        self.head_dim = c.head_dim
        self.num_key_value_groups = c.num_key_value_groups
        self.scaling = c.scaling
        self.attention_dropout = c.attention_dropout
        self.is_causal = c.is_causal
        # a per-layer window where the module keeps one, else the config's (read at every call)
        holder = c if hasattr(c, "sliding_window") else c.config
        self.sliding_window = getattr(holder, "sliding_window", None)
        self.output_gate = output_gate
        parts = [c.q_proj, c.k_proj, c.v_proj]
        self.split_sizes = [p.out_features for p in parts]
        self.qkv_proj = fuse_linears(parts, ["q_proj", "k_proj", "v_proj"])
        self.o_proj = c.o_proj
        self.q_norm = getattr(c, "q_norm", None)
        self.k_norm = getattr(c, "k_norm", None)
        self._rotary: Callable[..., Any] = sys.modules[type(c).__module__].apply_rotary_pos_emb
        # the attention backend may take the q|k|v output itself (a decode step's split, q/k
        # norms, RoPE, KV write and attention as one kernel; a prefill chunk's norms and RoPE
        # inside its KV write and attention): only for the rotate-half RoPE and plain RMS norms
        norms = (self.q_norm, self.k_norm)
        self._attend_from_qkv = (
            type(c).__module__ in _ROTATE_HALF_MODULES
            and not output_gate
            and self.sliding_window is None
            and (
                all(n is None for n in norms)
                or all(type(n).__name__ in _PLAIN_RMS_NORMS for n in norms)
            )
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if past_key_values is not None:
            raise RuntimeError("prepared attention writes caller-owned pages, not a Cache")
        qkv = self.qkv_proj(hidden_states)
        out, weights = self._attend(qkv, position_embeddings, attention_mask, **kwargs)
        return self.o_proj(out), weights

    def decode_fused(
        self,
        hidden_states: torch.Tensor,
        norm: nn.Module,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """residual + attention(norm(hidden_states)), for decode-sized inputs: the norm runs
        inside the q|k|v product and the residual add inside the o product (skinny_fused)."""
        if past_key_values is not None:
            raise RuntimeError("prepared attention writes caller-owned pages, not a Cache")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        qkv = skinny_fused(x, self.qkv_proj.weight, norm.weight, norm.variance_epsilon, False, None)
        qkv = qkv.view(*hidden_states.shape[:-1], -1)
        out, _ = self._attend(qkv, position_embeddings, attention_mask, **kwargs)
        y = skinny_fused(out.reshape(x.shape[0], -1), self.o_proj.weight, None, 0.0, False, x)
        return y.view_as(hidden_states)

    def decode_folded(
        self,
        hidden_states: torch.Tensor,
        eps: float,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """residual + attention(norm(hidden_states)) over folded weights (the norm's weight is
        in q|k|v's columns): 1/rms and the residual add inside the products (skinny_folded)."""
        if past_key_values is not None:
            raise RuntimeError("prepared attention writes caller-owned pages, not a Cache")
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        meta = kwargs.get("flare_meta")
        y = self._attend_o(None, x, position_embeddings, meta, eps)  # q|k|v in the launch too
        if y is not None:
            return y.view_as(hidden_states)
        qkv = skinny_folded(x, self.qkv_proj.weight, True, eps, False, None)
        qkv = qkv.view(*hidden_states.shape[:-1], -1)
        y = self._attend_o(qkv, x, position_embeddings, meta)
        if y is None:
            out, _ = self._attend(qkv, position_embeddings, attention_mask, **kwargs)
            y = skinny_folded(out.reshape(x.shape[0], -1), self.o_proj.weight, False, 0.0, False, x)
        return y.view_as(hidden_states)

    def _norms(self) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
        """The q/k norms' weights and epsilons, as the one-kernel attention takes them."""
        if self.q_norm is None or self.k_norm is None:
            return None
        return (self.q_norm.weight, self.k_norm.weight,
                self.q_norm.variance_epsilon, self.k_norm.variance_epsilon)  # fmt: skip

    def _attend_o(
        self,
        qkv: torch.Tensor | None,
        residual: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        meta: Any,
        eps: float = 0.0,
    ) -> torch.Tensor | None:
        """residual + o_proj(attention) of a one-row decode step in one launch (with qkv None,
        residual is the layer input and the folded q|k|v product with `eps` runs in it too),
        where the backend has it (`attend_o`) and this layer's attention runs from the q|k|v
        output; None otherwise."""
        fused = getattr(getattr(meta, "backend", None), "attend_o", None)
        if fused is None or not self._attend_from_qkv or residual.shape[0] != 1:
            return None
        if qkv is not None and tuple(qkv.shape[:-1]) != (1, 1):
            return None
        cos, sin = position_embeddings  # [1, 1, D]
        heads = self.split_sizes[0] // self.head_dim
        weight = self.qkv_proj.weight if self.qkv_proj.bias is None else None
        out: torch.Tensor | None = fused(
            self, None if qkv is None else qkv[0], residual, heads, self._norms(), cos[0], sin[0],
            meta, self.scaling, weight, eps,
        )  # fmt: skip
        return out

    def _attend(
        self,
        qkv: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Everything between the q|k|v and the o projections: split, norms, RoPE, attention."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        input_shape = qkv.shape[:-1]
        meta = kwargs.get("flare_meta")
        # decode: the whole attention in one launch; prefill: the norms and rotation inside the
        # KV write and the attention (no separate kernels between q|k|v and the attention)
        one_kernel = getattr(getattr(meta, "backend", None), "attend_from_qkv", None)
        if (
            one_kernel is not None
            and self._attend_from_qkv
            and getattr(meta, "mode", None) in ("decode", "prefill")
            and len(input_shape) == 2
            and input_shape[0] == 1
        ):
            cos, sin = position_embeddings  # [1, T, D]
            heads = self.split_sizes[0] // self.head_dim
            out = one_kernel(self, qkv[0], heads, self._norms(), cos[0], sin[0], meta, self.scaling)
            return out.view(*input_shape, -1), None
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = torch.chunk(q.view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
            gate = gate.reshape(*input_shape, -1)
        q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = self._rotary(q, k, cos, sin)
        attention = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, weights = attention(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )  # fmt: skip
        out = out.reshape(*input_shape, -1).contiguous()
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return out, weights


class FusedGateUpMLP(nn.Module):
    def __init__(self, canonical: nn.Module) -> None:
        super().__init__()
        c: Any = canonical
        self.gate_up_proj = fuse_linears([c.gate_proj, c.up_proj], ["gate_proj", "up_proj"])
        self.down_proj = c.down_proj
        self.act_fn = c.act_fn
        self.interleaved = False  # gate|up rows [g0, u0, g1, u1, ...] (a folded decode layer)
        self.one_launch = False  # decode rows through skinny_mlp (decode_gemm "mlp")

    def _flare_set_mlp(self, on: bool) -> None:
        """prep.components.fused.set_decode_gemm's hook: decode rows of a SiLU MLP without
        biases through one launch (prep.components.skinny_mlp), where that kernel exists."""
        self.one_launch = bool(
            on
            and skinny_mlp is not None
            and type(self.act_fn).__name__ in _SILU_ACTIVATIONS
            and self.gate_up_proj.bias is None
            and self.down_proj.bias is None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if self.one_launch and not self.interleaved and x.is_cuda and rows <= MAX_ROWS:
            y = skinny_mlp(x.reshape(rows, -1), self.gate_up_proj.weight, self.down_proj.weight)
            return y.view(*x.shape[:-1], -1)
        y = self.gate_up_proj(x)
        if self.interleaved:
            gate, up = y[..., 0::2], y[..., 1::2]
        else:
            gate, up = y.chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)

    def decode_folded(self, hidden_states: torch.Tensor, eps: float) -> torch.Tensor:
        """residual + mlp(norm(hidden_states)) over folded, interleaved gate|up rows: 1/rms
        and SiLU(gate) * up inside the gate|up product, the residual add inside down's."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        act = skinny_folded(x, self.gate_up_proj.weight, True, eps, True, None)
        return skinny_folded(act, self.down_proj.weight, False, 0.0, False, x).view_as(
            hidden_states
        )

    def decode_fused(self, hidden_states: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """residual + mlp(norm(hidden_states)) for decode-sized inputs: the norm inside the
        gate|up product, SiLU * up inside the down product, then the residual add."""
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        gu = skinny_fused(
            x, self.gate_up_proj.weight, norm.weight, norm.variance_epsilon, False, None
        )
        return skinny_fused(gu, self.down_proj.weight, None, 0.0, True, x).view_as(hidden_states)


# Norms computing weight * (x * rsqrt(mean(x^2) + eps)).to(dtype): what skinny_fused's norm
# prologue computes (Gemma-style 1 + weight norms are not among them).
_PLAIN_RMS_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
# modeling modules whose apply_rotary_pos_emb is q * cos + rotate_half(q) * sin over the whole
# head (the decode attention kernel's ROPE)
_ROTATE_HALF_MODULES = {
    f"transformers.models.{m}.modeling_{m}" for m in ("llama", "mistral", "qwen2", "qwen3")
}
# activations that are F.silu (torch's module and Transformers' own, by class name: the latter
# may be swapped for a hub kernel class of the same name)
_SILU_ACTIVATIONS = {"SiLU", "SiLUActivation"}


def _fusable(layer: nn.Module) -> bool:
    """Whether `layer` is the canonical pre-norm decoder layer over fused q|k|v and gate|up
    projections without biases, plain RMS norms and a SiLU MLP: the layer `decode_fused` runs."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not isinstance(attn, FusedQKVAttention) or not isinstance(mlp, FusedGateUpMLP):
        return False
    norms = (
        getattr(layer, "input_layernorm", None),
        getattr(layer, "post_attention_layernorm", None),
    )
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return (
        skinny_fused is not None
        and not attn.output_gate
        and all(type(n).__name__ in _PLAIN_RMS_NORMS for n in norms)
        and all(lin.bias is None for lin in linears)
        and type(mlp.act_fn).__name__ in _SILU_ACTIVATIONS
    )


def _fused_layer_forward(self: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """The decoder layer with its norms and residual adds inside the projections, for decode-
    sized inputs when the runner chose `decode_gemm="fused"` or `"folded"`; the canonical
    forward otherwise. Same dataflow as the canonical layer: h + attn(norm1(h)), then
    h + mlp(norm2(h))."""
    rows = hidden_states.numel() // hidden_states.shape[-1]
    meta = kwargs.get("flare_meta")
    single = rows == 1 and self._flare_single_folded and getattr(meta, "single_row", False)
    folded = self._flare_folded and (rows <= self._flare_folded_rows or single)
    if args or not (self._flare_fused or folded) or rows > MAX_ROWS:
        return self._flare_canonical_forward(hidden_states, *args, **kwargs)
    if folded:
        eps1 = self.input_layernorm.variance_epsilon
        h = self.self_attn.decode_folded(hidden_states, eps1, **kwargs)
        return self.mlp.decode_folded(h, self.post_attention_layernorm.variance_epsilon)
    h = self.self_attn.decode_fused(hidden_states, self.input_layernorm, **kwargs)
    return self.mlp.decode_fused(h, self.post_attention_layernorm)


FOLD_ROWS = 1024  # rows of a projection weight folded per step (bounds the fp32 temporary)


def _fold_columns(w: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """w[:, j] *= norm_weight[j], in place, computed in fp32 and rounded once (`fold_norm`)."""
    for a in range(0, w.shape[0], FOLD_ROWS):
        w[a : a + FOLD_ROWS].copy_(fold_norm(w[a : a + FOLD_ROWS], norm_weight))


def _set_decode(
    self: Any, kind: str, folded_rows: int = MAX_ROWS, single_folded: bool = False
) -> None:
    """prep.components.fused.set_decode_gemm's hook. "folded" rewrites this layer's weights
    once, in place: each RMSNorm's weight multiplied into the columns of the projection it
    feeds (the norm keeps a weight of ones, so prefill chunks run the canonical layer over the
    same weights) and gate|up's rows interleaved [g0, u0, g1, u1, ...] (the MLP splits them
    that way). The result is the same model, so "skinny" and "cublas" still apply afterwards;
    "fused" does not (its prologues read the norm weights and gate|up halves): refused.
    `folded_rows`: the folded forward runs decode steps of at most this many rows (0: none);
    larger ones run the canonical layer over the same folded weights (the skinny products).
    `single_folded` (with "folded"): the one-row executions of requests without a seed
    (AttentionMeta.single_row) run the folded forward whatever `folded_rows` says."""
    if kind == "folded" and not self._flare_weights_folded:
        attn, mlp = self.self_attn, self.mlp
        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        with torch.no_grad():
            _fold_columns(attn.qkv_proj.weight, n1.weight)
            n1.weight.fill_(1.0)
            w = mlp.gate_up_proj.weight
            _fold_columns(w, n2.weight)
            n2.weight.fill_(1.0)
            f = w.shape[0] // 2
            w.copy_(interleave_pairs(w[:f], w[f:]))  # one layer's gate|up as a temporary
        mlp.interleaved = True
        for lin in (attn.qkv_proj, mlp.gate_up_proj):  # no longer the checkpoint's rows
            lin.__dict__.pop("_flare_sources", None)
        self._flare_weights_folded = True
    if kind == "fused" and self._flare_weights_folded:
        raise ValueError("decode_gemm 'fused' after 'folded': the weights are folded; reload")
    self._flare_fused = kind == "fused"
    self._flare_folded = kind == "folded"
    self._flare_folded_rows = folded_rows
    self._flare_single_folded = kind == "folded" and single_folded


_FUSED_CLASSES: dict[type, type] = {}


def _make_fusable(layer: nn.Module) -> None:
    """Give `layer` the fused and folded decode forwards (off until `set_decode_gemm`)."""
    base = type(layer)
    cls = _FUSED_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "forward": _fused_layer_forward, "_flare_canonical_forward": base.forward,
            "_flare_set_decode": _set_decode,
        })  # fmt: skip
        _FUSED_CLASSES[base] = cls
    layer.__class__ = cls
    layer._flare_fused = False  # type: ignore[assignment]
    layer._flare_folded = False  # type: ignore[assignment]
    layer._flare_folded_rows = MAX_ROWS  # type: ignore[assignment]
    layer._flare_single_folded = False  # type: ignore[assignment]
    layer._flare_weights_folded = False  # type: ignore[assignment]


def apply_layout(model: nn.Module, layout: Layout) -> None:
    """Replace each decoder layer's attention / MLP by its fused form, as `layout` declares,
    then route every linear layer through PreparedLinear."""
    layers: Any = model.base_model.layers  # type: ignore[union-attr]
    for layer in layers:
        if layout.fused_qkv:
            layer.self_attn = FusedQKVAttention(layer.self_attn)
        if layout.fused_gate_up:
            layer.mlp = FusedGateUpMLP(layer.mlp)
        if _fusable(layer):
            _make_fusable(layer)
    prepare_linears(model)
