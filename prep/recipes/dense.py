"""Dense causal-attention decoders: Llama, Qwen2, Qwen3, Mistral-style.

Attention runs through the paged-attention implementation; the execution layout fuses q/k/v and
gate/up into one weight each (dense_modules.py: the canonical blocks over fused weights);
embeddings, norms, RoPE and the vocabulary head stay the canonical Transformers modules. Sampling defaults are
declared here from each family's model card for its default serving mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prep.bundle import Geometry, Layout, ReasoningParser, SamplingDefaults, ToolParser
from prep.errors import UnsupportedModel
from prep.recipes import register

# Rope variants whose frequencies do not depend on the sequence being processed; "dynamic"
# rescales with the current length, which a static prepared execution cannot follow.
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn", "longrope", "proportional"}
_LAYER_TYPES = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class _Family:
    name: str
    sampling: SamplingDefaults
    reasoning: ReasoningParser
    tools: ToolParser


class DenseRecipe:
    def __init__(self, family: _Family) -> None:
        self.family = family
        self.name = f"dense/{family.name}"

    def validate(self, config: Any) -> None:
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        if rope_type not in _STATIC_ROPE_TYPES:
            raise UnsupportedModel(
                f"rope type {rope_type!r} is not supported (static prepared executions need one "
                f"of {sorted(_STATIC_ROPE_TYPES)})"
            )
        layer_types = getattr(config, "layer_types", None) or []
        bad = sorted(set(layer_types) - _LAYER_TYPES)
        if bad:
            raise UnsupportedModel(f"layer types {bad} are not supported by {self.name}")
        if "sliding_attention" in layer_types and getattr(config, "sliding_window", None) is None:
            raise UnsupportedModel("sliding_attention layers declared without a sliding_window")
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        if heads % kv:
            raise UnsupportedModel(f"{heads} query heads are not a multiple of {kv} kv heads")

    def geometry(self, config: Any, page_size: int) -> Geometry:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        layer_types = getattr(config, "layer_types", None) or []
        # as the canonical attention applies it: by layer type where the config declares them
        # (Qwen2, Qwen3), else config.sliding_window whenever it is set (Mistral's attention
        # reads it at every call) unless the config switches windows off
        window = getattr(config, "sliding_window", None)
        if layer_types:
            window = window if "sliding_attention" in layer_types else None
        elif getattr(config, "use_sliding_window", True) is False:
            window = None
        if window is not None and any(t != "sliding_attention" for t in layer_types):
            raise UnsupportedModel(
                "mixed sliding/full attention layers are not supported yet: "
                f"layer_types={sorted(set(layer_types))}"
            )
        return Geometry(
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            num_layers=int(config.num_hidden_layers),
            attention_layers=list(range(int(config.num_hidden_layers))),
            num_q_heads=heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            page_size=page_size,
            sliding_window=int(window) if window is not None else None,
        )

    def sampling_defaults(self, config: Any) -> SamplingDefaults:
        return self.family.sampling

    def parsers(self, config: Any) -> tuple[ReasoningParser, ToolParser]:
        return self.family.reasoning, self.family.tools

    def layout(self, config: Any) -> Layout:
        return Layout(fused_qkv=True, fused_gate_up=True)

    def prepare_modules(self, model: Any, layout: Layout) -> None:
        from prep.recipes.dense_modules import apply_layout

        apply_layout(model, layout)


# Model-card recommendations for the default serving mode of each family.
_LLAMA = _Family(  # Llama 3.x instruct: temperature 0.6, top-p 0.9
    "llama",
    SamplingDefaults(temperature=0.6, top_p=0.9),
    ReasoningParser.NONE,
    ToolParser.NONE,
)
_QWEN2 = _Family(  # Qwen2.5 instruct: temperature 0.7, top-p 0.8, top-k 20, repetition 1.05
    "qwen2",
    SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
    ReasoningParser.NONE,
    ToolParser.HERMES_JSON,
)
_QWEN3 = _Family(  # Qwen3 thinking mode: temperature 0.6, top-p 0.95, top-k 20, min-p 0
    "qwen3",
    SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0),
    ReasoningParser.THINK_TAGS,
    ToolParser.HERMES_JSON,
)
_MISTRAL = _Family(  # Mistral instruct: temperature 0.7
    "mistral",
    SamplingDefaults(temperature=0.7),
    ReasoningParser.NONE,
    ToolParser.NONE,
)


@register("LlamaForCausalLM")
def _llama() -> DenseRecipe:
    return DenseRecipe(_LLAMA)


@register("Qwen2ForCausalLM")
def _qwen2() -> DenseRecipe:
    return DenseRecipe(_QWEN2)


@register("Qwen3ForCausalLM")
def _qwen3() -> DenseRecipe:
    return DenseRecipe(_QWEN3)


@register("MistralForCausalLM")
def _mistral() -> DenseRecipe:
    return DenseRecipe(_MISTRAL)
