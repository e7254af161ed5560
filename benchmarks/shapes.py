"""Random-weight checkpoints of realistic shapes for GPU benchmarks (weights cannot be downloaded)."""

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


def make_checkpoint(shape: str, out: Path, device: str = "cuda") -> Path:
    """save_pretrained of a random bf16 Qwen3 model of the named shape, plus the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from prep.tiny import write_tokenizer

    if (out / "config.json").is_file():
        return out
    write_tokenizer(out)
    config = Qwen3Config(eos_token_id=2, **SHAPES[shape])
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    del model
    return out
