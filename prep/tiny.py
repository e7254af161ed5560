"""Tiny random-weight checkpoints of real Transformers architectures, built offline.

`flare demo` and the test-suite use these: a small byte-level BPE tokenizer trained with
`tokenizers` on a built-in corpus, a ChatML chat template, and a `save_pretrained` checkpoint of
a small config for a registered architecture. New architectures drop in by registering a
config builder with `register_tiny`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tc.function.name + \'", "arguments": \' }}'
    "{{- tc.function.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while a small model learns to answer "
    "questions about weather tools files code python json functions arguments results "
    "hello world flare serves agents on one machine with memory bandwidth and pages "
    "conversation tool call response reasoning think answer user assistant system "
    "Bonjour le monde, héllo wörld, 你好世界, こんにちは, emoji 🙂🚀 numbers 0123456789 "
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} '
    "def main(): return 42  # comment\n\tindent\n"
)


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained deterministically on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [_CORPUS_WORDS] * 4 + [w for w in _CORPUS_WORDS.split()]
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int = 512) -> int:
    """Write tokenizer.json + tokenizer_config.json; returns the tokenizer's vocabulary size."""
    tok = build_tokenizer(vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {
                "content": t,
                "special": True,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
            }
            for t in SPECIAL_TOKENS
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return int(tok.get_vocab_size())


ConfigBuilder = Callable[[int, int], Any]
WeightAdjust = Callable[[Any], None]


@dataclass(frozen=True)
class Published:
    """How a family's checkpoints are published, beyond Transformers' original tensor format
    (one tensor per MoE expert): the vision-language wrapper whose `text_config` is the
    language model (Transformers class names), and a multi-token-prediction head."""

    wrapper_config: str | None = None
    wrapper_model: str | None = None
    mtp: bool = False


_TINY_CONFIGS: dict[str, ConfigBuilder] = {}
_TINY_ADJUST: dict[str, WeightAdjust] = {}
_TINY_PUBLISHED: dict[str, Published] = {}


def register_tiny(
    model_type: str, adjust: WeightAdjust | None = None, published: Published | None = None
) -> Callable[[ConfigBuilder], ConfigBuilder]:
    """`adjust(model)` runs after the random init, for families whose defaults hide behaviour."""

    def deco(fn: ConfigBuilder) -> ConfigBuilder:
        _TINY_CONFIGS[model_type] = fn
        if adjust is not None:
            _TINY_ADJUST[model_type] = adjust
        if published is not None:
            _TINY_PUBLISHED[model_type] = published
        return fn

    return deco


def tiny_model_types() -> tuple[str, ...]:
    return tuple(sorted(_TINY_CONFIGS))


_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
)


@register_tiny("llama")
def _llama(vocab_size: int, eos_id: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, eos_token_id=eos_id, tie_word_embeddings=False, **_COMMON
    )


@register_tiny("qwen2")
def _qwen2(vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, eos_token_id=eos_id, tie_word_embeddings=False, **_COMMON
    )


@register_tiny("qwen3")
def _qwen3(vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        head_dim=16,
        tie_word_embeddings=True,
        **_COMMON,
    )


@register_tiny("mistral")
def _mistral(vocab_size: int, eos_id: int) -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        sliding_window=None,
        tie_word_embeddings=False,
        **_COMMON,
    )


# Hybrid Gated DeltaNet decoders: linear-attention layers around a gated full-attention layer,
# small enough for CPU tests but with every structural feature (GQA in both mixers, value heads
# a multiple of key heads, partial rotary, output gates, and for qwen3_next a routed MoE with a
# shared expert).
_HYBRID = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
)


def _long_memory(model: Any) -> None:
    """Decay rates exp(A_log) in [0.01, 0.5] instead of up to 16, so the recurrent state carries
    information across many tokens and a wrong state shows in the logits."""
    import torch

    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.empty_like(p).uniform_(0.01, 0.5).log_())


@register_tiny("qwen3_next", adjust=_long_memory, published=Published(mtp=True))
def _qwen3_next(vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
        },
        **_HYBRID,
    )


@register_tiny(
    "qwen3_5",
    adjust=_long_memory,
    published=Published("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", mtp=True),
)
def _qwen3_5(vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **_HYBRID,
    )


@register_tiny(
    "qwen3_5_moe",
    adjust=_long_memory,
    published=Published("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", mtp=True),
)
def _qwen3_5_moe(vocab_size: int, eos_id: int) -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **_HYBRID,
    )


def make_tiny_checkpoint(
    out_dir: Path | str,
    model_type: str = "qwen3",
    *,
    seed: int = 0,
    dtype: str = "float32",
    vocab_size: int = 512,
    config_overrides: dict[str, Any] | None = None,
    published: bool = False,
) -> Path:
    """Build and `save_pretrained` a tiny random-weight checkpoint plus tokenizer in `out_dir`.

    By default in the model's own (in-memory) layout. `published=True` writes the same weights
    the way the family's checkpoints are published: experts one tensor each, inside the
    vision-language wrapper (with a tiny random vision tower) where the family has one, plus a
    random multi-token-prediction head, sharded over several files with an index.
    """
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    if model_type not in _TINY_CONFIGS:
        raise ValueError(
            f"no tiny config for model_type {model_type!r}; registered: {tiny_model_types()}"
        )
    tok_vocab = write_tokenizer(out, vocab_size)
    from tokenizers import Tokenizer

    eos_id = Tokenizer.from_file(str(out / "tokenizer.json")).token_to_id(EOS_TOKEN)
    config = _TINY_CONFIGS[model_type](max(vocab_size, tok_vocab), eos_id)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # random init is tiny-valued; widen it so logits are not uniform
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        if model_type in _TINY_ADJUST:
            _TINY_ADJUST[model_type](model)
    if not published:
        # The model's own layout (fused experts), as Transformers holds it in memory.
        model.save_pretrained(out, safe_serialization=True, save_original_format=False)
        return out
    form = _TINY_PUBLISHED.get(model_type, Published())
    if form.wrapper_model is not None:
        model = _wrapped(model, form)
    shard = max(64 * 1024, sum(p.nbytes for p in model.parameters()) // 4)
    model.save_pretrained(out, safe_serialization=True, save_original_format=True,
                          max_shard_size=shard)  # fmt: skip
    if form.mtp:
        _add_mtp_head(out, model.config.get_text_config(), getattr(torch, dtype))
    return out


def _wrapped(model: Any, form: Published) -> Any:
    """The published wrapper around `model`'s exact weights (its vision tower random)."""
    import torch
    import transformers

    text = model.config.to_dict()
    for key in ("architectures", "transformers_version", "dtype"):
        text.pop(key, None)
    hidden = int(model.config.hidden_size)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4,
                  num_position_embeddings=16, out_hidden_size=hidden)  # fmt: skip
    config = getattr(transformers, str(form.wrapper_config))(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=bool(model.config.tie_word_embeddings),
    )
    wrapper = getattr(transformers, str(form.wrapper_model))(config).to(model.dtype)
    with torch.no_grad():
        wrapper.model.language_model.load_state_dict(model.model.state_dict())
        wrapper.lm_head.weight.copy_(model.lm_head.weight)
    return wrapper


def _add_mtp_head(out: Path, text_config: Any, dtype: Any) -> None:
    """A random multi-token-prediction head in its own shard, listed in the index like the
    published checkpoints' (Transformers ignores it; prep reports it as not loaded)."""
    import torch
    from safetensors.torch import save_file

    h = int(text_config.hidden_size)
    tensors = {
        "mtp.fc.weight": torch.randn(h, 2 * h, dtype=dtype),
        "mtp.norm.weight": torch.ones(h, dtype=dtype),
        "mtp.pre_fc_norm_embedding.weight": torch.ones(h, dtype=dtype),
        "mtp.pre_fc_norm_hidden.weight": torch.ones(h, dtype=dtype),
        "mtp.layers.0.input_layernorm.weight": torch.ones(h, dtype=dtype),
    }
    save_file(tensors, str(out / "model-mtp.safetensors"), metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, "model-mtp.safetensors"))
        index.write_text(json.dumps(data, indent=2) + "\n")
