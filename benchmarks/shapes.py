"""Random-weight checkpoints of realistic shapes for GPU benchmarks (weights cannot be downloaded).

python benchmarks/shapes.py SHAPE OUT_DIR [--vocab N]    # write one checkpoint (CUDA)

--vocab N replaces the shape's vocabulary by the tiny tokenizer's own N tokens, so every sampled
id detokenizes to text (what an HTTP benchmark needs; the lm_head shrinks accordingly).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
    "qwen3-8b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
        max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    ),
}  # fmt: skip

# Gated DeltaNet hybrids (dense MLP): Transformers' Qwen3.5 text defaults, a 9B-class decoder
# with 3 linear-attention layers per full-attention layer, and a 2B-class one of the same
# structure. Decay rates are drawn as in trained checkpoints (A_log ~ log U(1, 16)).
HYBRID_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3.5-9b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        vocab_size=248320, tie_word_embeddings=False, max_position_embeddings=32768,
    ),
    "qwen3.5-2b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=32768,
    ),
}  # fmt: skip


def _config(shape: str, vocab: int | None = None) -> Any:
    from transformers import Qwen3_5TextConfig, Qwen3Config

    if shape in HYBRID_SHAPES:
        config = Qwen3_5TextConfig(
            eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                             "partial_rotary_factor": 0.25},
            **HYBRID_SHAPES[shape],
        )  # fmt: skip
        config.architectures = ["Qwen3_5ForCausalLM"]
        return config
    config = Qwen3Config(
        eos_token_id=2, **{**SHAPES[shape], **({"vocab_size": vocab} if vocab else {})}
    )
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def make_checkpoint(shape: str, out: Path, device: str = "cuda", vocab: int | None = None) -> Path:
    """save_pretrained of a random bf16 model of the named shape, plus the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from prep.tiny import write_tokenizer

    if (out / "config.json").is_file():
        return out
    tokens = write_tokenizer(out, vocab or 512)
    config = _config(shape, tokens if vocab else None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log_())
    model.save_pretrained(out, safe_serialization=True, save_original_format=False)
    del model
    return out


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    vocab = int(sys.argv[sys.argv.index("--vocab") + 1]) if "--vocab" in sys.argv else None
    print(make_checkpoint(sys.argv[1], Path(sys.argv[2]), vocab=vocab))
