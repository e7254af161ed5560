"""Prepared attention and MLP blocks of the dense decoders, over fused projection weights.

They reproduce the canonical Llama/Qwen2/Qwen3/Mistral blocks operation for operation (the
parity tests against the unmodified Transformers model pin this), with two changes of layout
only: q/k/v are one projection (`qkv_proj`) and gate/up are one (`gate_up_proj`). Everything
else is the canonical module's own parts: its q/k norms, o_proj, activation, the modeling
module's `apply_rotary_pos_emb`, and the attention implementation selected in the config (the
paged one).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from prep.bundle import Layout
from prep.components.fused import fuse_linears, prepare_linears


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
        self.sliding_window = getattr(c, "sliding_window", None)
        self.output_gate = output_gate
        parts = [c.q_proj, c.k_proj, c.v_proj]
        self.split_sizes = [p.out_features for p in parts]
        self.qkv_proj = fuse_linears(parts, ["q_proj", "k_proj", "v_proj"])
        self.o_proj = c.o_proj
        self.q_norm = getattr(c, "q_norm", None)
        self.k_norm = getattr(c, "k_norm", None)
        self._rotary: Callable[..., Any] = sys.modules[type(c).__module__].apply_rotary_pos_emb

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if past_key_values is not None:
            raise RuntimeError("prepared attention writes caller-owned pages, not a Cache")
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(self.split_sizes, dim=-1)
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
        return self.o_proj(out), weights


class FusedGateUpMLP(nn.Module):
    def __init__(self, canonical: nn.Module) -> None:
        super().__init__()
        c: Any = canonical
        self.gate_up_proj = fuse_linears([c.gate_proj, c.up_proj], ["gate_proj", "up_proj"])
        self.down_proj = c.down_proj
        self.act_fn = c.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def apply_layout(model: nn.Module, layout: Layout) -> None:
    """Replace each decoder layer's attention / MLP by its fused form, as `layout` declares,
    then route every linear layer through PreparedLinear."""
    layers: Any = model.base_model.layers  # type: ignore[union-attr]
    for layer in layers:
        if layout.fused_qkv:
            layer.self_attn = FusedQKVAttention(layer.self_attn)
        if layout.fused_gate_up:
            layer.mlp = FusedGateUpMLP(layer.mlp)
    prepare_linears(model)
