"""Gated DeltaNet hybrids: Qwen3-Next and Qwen3.5-style decoders (dense and MoE).

Two token mixers alternate by `config.layer_types`:

- "full_attention" layers run the canonical Transformers attention (q/k norms, partial rotary,
  the sigmoid output gate folded into q_proj) with the registered paged-attention implementation,
  exactly as in the dense recipe; the execution layout fuses q|k|v into one weight
  (`FusedQKVAttention(output_gate=True)`).
- "linear_attention" layers are replaced by `PreparedGatedDeltaNet`, which keeps the canonical
  parameters under their names and runs the convolution and the gated delta rule over the state
  pool through `prep.components.gated_deltanet` with explicit state rows; the execution layout
  fuses its input projections into one weight (`in_proj`).
- Dense MLPs (an MoE block's shared expert included) fuse gate|up as in the dense recipe.

Fusing siblings matters most for the chunks an agent turn prefills (a few hundred rows): on the
H200, a Qwen3.5-9B layer's four input projections at 384 rows take 75 µs as four GEMMs and 55 µs
as one (`benchmarks/prefill_gemm.py`). Stored tensors keep their checkpoint names either way.

Model semantics live here: how each family's projections split into q|k|v, the gate z and the
decay inputs b, a; the decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b); the
gated RMSNorm and the output projection. The layout of the per-row state is declared in the
manifest geometry (`state_tensors`), so a family with more per-layer state (e.g. further
convolution or token-context histories) adds entries there without touching shared code.

Checkpoints as published are declared here too (`prep.recipes.checkpoints`): Qwen3.5 ships as
a vision-language `…ForConditionalGeneration` whose language model is prepared alone (the
vision encoder listed as not loaded), the MoE families store one tensor per expert (written
into slices of Transformers' stacked expert parameters), and every family carries a
multi-token-prediction head that is listed as not loaded. The bundle is the one the same
weights in Transformers' in-memory text-only layout give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from prep.bundle import (
    Geometry,
    Layout,
    ReasoningParser,
    SamplingDefaults,
    StateTensor,
    ToolParser,
)
from prep.components import gated_deltanet as gdn
from prep.components.fused import fuse_linears
from prep.errors import UnsupportedModel
from prep.recipes import register, register_wrapper
from prep.recipes.checkpoints import Skip, SourceLayout, Stacked, StackedPart, Wrapper

_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope", "proportional"}
_FULL, _LINEAR = "full_attention", "linear_attention"

# the family's input projections' outputs, in `inputs` order -> (mixed_qkv [T, C], z [T, Hv, Dv],
# b [T, Hv], a [T, Hv])
Projection = Callable[["PreparedGatedDeltaNet", list[torch.Tensor]], tuple[torch.Tensor, ...]]
_GROUPED_INPUTS = ("in_proj_qkvz", "in_proj_ba")
_SPLIT_INPUTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def _project_grouped(
    m: PreparedGatedDeltaNet, outs: list[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    """Qwen3-Next: one qkvz and one ba projection, grouped by key head:
    per key head [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] and [b (r) | a (r)], r = Hv / Hk."""
    s, (qkvz, ba) = m.shape, outs
    t = qkvz.shape[0]
    r = s.num_v_heads // s.num_k_heads
    qkvz = qkvz.view(t, s.num_k_heads, 2 * s.head_k_dim + 2 * r * s.head_v_dim)
    q, k, v, z = torch.split(
        qkvz, [s.head_k_dim, s.head_k_dim, r * s.head_v_dim, r * s.head_v_dim], 2
    )
    b, a = torch.split(ba.view(t, s.num_k_heads, 2 * r), [r, r], dim=2)
    mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
    return (mixed, z.reshape(t, s.num_v_heads, s.head_v_dim), b.reshape(t, -1), a.reshape(t, -1))


def _project_split(m: PreparedGatedDeltaNet, outs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Qwen3.5: separate qkv (already [q | k | v]), z, b and a projections."""
    s, (qkv, z, b, a) = m.shape, outs
    return qkv, z.view(qkv.shape[0], s.num_v_heads, s.head_v_dim), b, a


class PreparedGatedDeltaNet(torch.nn.Module):
    """Drop-in for a Transformers GatedDeltaNet layer; reads `flare_state` metadata.

    hidden_states [1, T, H] -> [1, T, H]; T tokens of one request (prefill) or one token of
    each of T requests (decode), as the metadata's mode says.
    """

    def __init__(
        self, canonical: torch.nn.Module, project: Projection, inputs: tuple[str, ...]
    ) -> None:
        super().__init__()
        for name, child in canonical.named_children():  # same parameter names as canonical
            self.add_module(name, child)
        for name, p in canonical.named_parameters(recurse=False):
            self.register_parameter(name, p)
        if getattr(canonical.conv1d, "bias", None) is not None:
            raise UnsupportedModel("GatedDeltaNet convolution with a bias is not supported")
        if canonical.activation != "silu":
            raise UnsupportedModel(f"GatedDeltaNet activation {canonical.activation!r} != silu")
        self.layer_idx = int(canonical.layer_idx)
        self.state_names: tuple[str, ...] = ()  # bound pool tensors (bind_state)
        self.shape = shape_of(canonical)
        self._project = project
        self.inputs = inputs  # the input projections' names, in the order `project` takes them
        self.in_split: list[int] = []  # their output sizes once fused into `in_proj`

    def fuse_inputs(self) -> None:
        """Replace the input projections by one weight (`in_proj`), loaded by their names' row
        ranges: one GEMM per chunk instead of two or four (idempotent)."""
        if self.in_split:
            return
        parts = [getattr(self, n) for n in self.inputs]
        self.in_proj = fuse_linears(parts, list(self.inputs))
        self.in_split = [p.out_features for p in parts]
        for n in self.inputs:
            delattr(self, n)

    def project_inputs(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.in_split:
            return list(self.in_proj(x).split(self.in_split, dim=-1))
        return [getattr(self, n)(x) for n in self.inputs]

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Attach this layer's pool tensors as non-persistent buffers, so traced code reads them
        without specialising on the layer index (one compiled layer serves every GDN layer)."""
        for name, t in tensors.items():
            self.register_buffer(f"flare_state_{name}", t, persistent=False)
        self.state_names = tuple(tensors)

    def layer_state(self, meta: gdn.RecurrentMeta) -> dict[str, torch.Tensor]:
        if self.state_names:
            return {n: getattr(self, f"flare_state_{n}") for n in self.state_names}
        return meta.pool.layer_tensors(self.layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache_params: Any = None,
        attention_mask: torch.Tensor | None = None,
        flare_state: gdn.RecurrentMeta | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if flare_state is None:
            raise RuntimeError("prepared GatedDeltaNet called without flare_state metadata")
        x = hidden_states[0]  # [T, H]
        t, dv = x.shape[0], self.shape.head_v_dim
        mixed, z, b, a = self._project(self, self.project_inputs(x))
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv] fp32
        weight = self.conv1d.weight[:, 0, :]  # [C, K]
        o = gdn.mix(flare_state, self.layer_state(flare_state), self.shape, mixed, weight, g, beta)
        o = self.norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, t, -1)
        return self.out_proj(o)


def shape_of(m: Any) -> gdn.GDNShape:
    return gdn.GDNShape(
        num_k_heads=int(m.num_k_heads), num_v_heads=int(m.num_v_heads),
        head_k_dim=int(m.head_k_dim), head_v_dim=int(m.head_v_dim),
        conv_kernel=int(m.conv_kernel_size),
    )  # fmt: skip


def _config_shape(config: Any) -> gdn.GDNShape:
    return gdn.GDNShape(
        num_k_heads=int(config.linear_num_key_heads),
        num_v_heads=int(config.linear_num_value_heads),
        head_k_dim=int(config.linear_key_head_dim),
        head_v_dim=int(config.linear_value_head_dim),
        conv_kernel=int(config.linear_conv_kernel_dim),
    )


class HybridRecipe:
    def __init__(
        self,
        name: str,
        project: Projection,
        inputs: tuple[str, ...],
        sampling: SamplingDefaults,
        reasoning: ReasoningParser,
        tools: ToolParser,
        source: SourceLayout,
    ) -> None:
        self.name = f"hybrid/{name}"
        self.project = project
        self.inputs = inputs
        self.sampling = sampling
        self.reasoning = reasoning
        self.tools = tools
        self.source = source

    def validate(self, config: Any) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _STATIC_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {rope_type!r} is not supported (static prepared executions need one "
                f"of {sorted(_STATIC_ROPE_TYPES)})"
            )
        layer_types = list(getattr(config, "layer_types", None) or [])
        bad = sorted(set(layer_types) - {_FULL, _LINEAR})
        if bad or len(layer_types) != int(config.num_hidden_layers):
            raise UnsupportedModel(
                f"layer types {bad or layer_types} are not supported by {self.name}"
            )
        heads, kv = int(config.num_attention_heads), int(config.num_key_value_heads)
        if heads % kv:
            raise UnsupportedModel(f"{heads} query heads are not a multiple of {kv} kv heads")
        s = _config_shape(config)
        if s.num_v_heads % s.num_k_heads:
            raise UnsupportedModel(
                f"{s.num_v_heads} linear value heads are not a multiple of {s.num_k_heads} key heads"
            )
        if str(getattr(config, "hidden_act", "silu")) != "silu":
            raise UnsupportedModel(f"hidden_act {config.hidden_act!r} is not supported (silu)")
        if s.conv_kernel < 2:
            raise UnsupportedModel(f"linear_conv_kernel_dim {s.conv_kernel} must be at least 2")

    def geometry(self, config: Any, page_size: int) -> Geometry:
        layer_types = list(config.layer_types)
        heads = int(config.num_attention_heads)
        shape = _config_shape(config)
        state: list[StateTensor] = []
        for i, kind in enumerate(layer_types):
            if kind == _LINEAR:
                state.extend(gdn.state_tensors(i, shape))
        return Geometry(
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            num_layers=int(config.num_hidden_layers),
            attention_layers=[i for i, kind in enumerate(layer_types) if kind == _FULL],
            num_q_heads=heads,
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
            page_size=page_size,
            state_tensors=state,
        )

    def sampling_defaults(self, config: Any) -> SamplingDefaults:
        return self.sampling

    def parsers(self, config: Any) -> tuple[ReasoningParser, ToolParser]:
        return self.reasoning, self.tools

    def source_layout(self, config: Any) -> SourceLayout:
        """How published checkpoints of the family differ from the model's parameter names."""
        return self.source

    def layout(self, config: Any) -> Layout:
        return Layout(fused_qkv=True, fused_gate_up=True, fused_gdn_in=True)

    def prepare_modules(self, model: torch.nn.Module, layout: Layout) -> None:
        """Fuse sibling projections as `layout` declares: each Gated DeltaNet layer's input
        projections, each attention block's q (with its output gate) / k / v, and the gate / up
        of every dense MLP (an MoE block's shared expert included; routed experts are stacked
        already)."""
        from prep.recipes.dense_modules import FusedGateUpMLP, FusedQKVAttention

        self.prepare_state_modules(model)
        for i, kind in enumerate(model.config.layer_types):
            layer = model.base_model.layers[i]
            if kind == _LINEAR and layout.fused_gdn_in:
                layer.linear_attn.fuse_inputs()
            if (
                kind == _FULL
                and layout.fused_qkv
                and not isinstance(layer.self_attn, FusedQKVAttention)
            ):
                layer.self_attn = FusedQKVAttention(layer.self_attn, output_gate=True)
            if layout.fused_gate_up:
                for name, mod in list(layer.named_modules()):
                    if type(mod).__name__ in _DENSE_MLPS:
                        parent, _, child = name.rpartition(".")
                        setattr(layer.get_submodule(parent), child, FusedGateUpMLP(mod))

    def prepare_state_modules(self, model: torch.nn.Module) -> None:
        """Replace every linear-attention layer's canonical GatedDeltaNet (idempotent)."""
        layers = model.base_model.layers
        for i, kind in enumerate(model.config.layer_types):
            if kind == _LINEAR and not isinstance(layers[i].linear_attn, PreparedGatedDeltaNet):
                layers[i].linear_attn = PreparedGatedDeltaNet(
                    layers[i].linear_attn, self.project, self.inputs
                )


# The families' dense gated MLPs (down(act(gate(x)) * up(x))), which FusedGateUpMLP reproduces.
_DENSE_MLPS = frozenset({"Qwen3NextMLP", "Qwen3_5MLP", "Qwen3_5MoeMLP"})

# Published checkpoints carry a multi-token-prediction head beside the decoder (`mtp.*`), and
# the MoE families store one tensor per expert where Transformers stacks them into
# experts.gate_up_proj [E, 2I, H] (gate rows first, then up) and experts.down_proj [E, H, I].
_MTP = Skip(r"^mtp\.", "multi-token-prediction head: Flare does not run speculative decoding")
_EXPERTS = Stacked(
    pattern=r"^(?P<stack>.+\.mlp\.experts)\.(?P<index>\d+)\.(?P<part>gate_proj|up_proj|down_proj)"
    r"\.weight$",
    parts={
        "gate_proj": StackedPart("gate_up_proj", chunk=0, chunks=2),
        "up_proj": StackedPart("gate_up_proj", chunk=1, chunks=2),
        "down_proj": StackedPart("down_proj"),
    },
    unit="expert",
)
_DENSE_SOURCE = SourceLayout(skip=(_MTP,))
_MOE_SOURCE = SourceLayout(skip=(_MTP,), stacked=(_EXPERTS,))

# Qwen3.5 is published as a vision-language model: the language model under
# model.language_model.*, the vision encoder under model.visual.*, the head at lm_head.*.
_TEXT_OF_VLM = SourceLayout(
    renames=((r"^model\.language_model\.", "model."),),
    skip=(
        Skip(r"^(model\.)?visual\.", "vision encoder: image and video inputs are not served yet"),
    ),
)
register_wrapper(Wrapper("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", _TEXT_OF_VLM))
register_wrapper(
    Wrapper("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", _TEXT_OF_VLM)
)

# Model-card recommendations for the default serving mode of each family.
_QWEN3_NEXT_SAMPLING = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0)
_QWEN3_5_SAMPLING = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0)


@register("Qwen3NextForCausalLM")
def _qwen3_next() -> HybridRecipe:  # Qwen3-Next instruct: temperature 0.7, top-p 0.8, top-k 20
    return HybridRecipe(
        "qwen3_next", _project_grouped, _GROUPED_INPUTS, _QWEN3_NEXT_SAMPLING, ReasoningParser.THINK_TAGS,
        ToolParser.HERMES_JSON, _MOE_SOURCE,
    )  # fmt: skip


@register("Qwen3_5ForCausalLM")
def _qwen3_5() -> HybridRecipe:  # Qwen3.5 thinking mode: temperature 0.6, top-p 0.95, top-k 20
    return HybridRecipe(
        "qwen3_5", _project_split, _SPLIT_INPUTS, _QWEN3_5_SAMPLING, ReasoningParser.THINK_TAGS,
        ToolParser.QWEN_XML, _DENSE_SOURCE,
    )  # fmt: skip


@register("Qwen3_5MoeForCausalLM")
def _qwen3_5_moe() -> HybridRecipe:  # the Qwen3.5 MoE models share the dense ones' model card
    return HybridRecipe(
        "qwen3_5_moe", _project_split, _SPLIT_INPUTS, _QWEN3_5_SAMPLING, ReasoningParser.THINK_TAGS,
        ToolParser.QWEN_XML, _MOE_SOURCE,
    )  # fmt: skip
