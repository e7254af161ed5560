"""Build the canonical Transformers model with prepared attention and load bundle weights.

Used by preparation (on the meta device, for tensor accounting) and by `flared` at load time
(on the serving device). The model is constructed once, without random initialisation, and
every stored tensor is copied straight into its parameter: no second full copy exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from prep.bundle import Layout
from prep.components import paged_attention
from prep.components.fused import weight_targets

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_config(directory: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))


def build_model(
    config: Any, device: torch.device | str, dtype: torch.dtype, layout: Layout | None = None
) -> torch.nn.Module:
    """The canonical CausalLM with the paged-attention implementation and the recipe's module
    surgery for `layout` (None: the canonical layout), weights uninitialised."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    paged_attention.register()
    with no_init_weights(), torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=paged_attention.ATTN_IMPLEMENTATION
        )
        _apply_layout(model, config, layout)
    model.tie_weights()  # no_init_weights skips the tying that post-init would do
    model.eval()
    model.requires_grad_(False)
    return model


def build_meta_model(config: Any, layout: Layout | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    paged_attention.register()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=paged_attention.ATTN_IMPLEMENTATION
        )
        _apply_layout(model, config, layout)
    return model


def _apply_layout(model: torch.nn.Module, config: Any, layout: Layout | None) -> None:
    from prep import recipes

    recipes.prepare_state_modules(model)  # recurrent layers over the state pool, if any
    if layout is None or layout == Layout():
        return
    recipes.resolve(config).prepare_modules(model, layout)


def load_weights(model: torch.nn.Module, files: list[Path], device: torch.device | str) -> int:
    """Copy every stored tensor into its parameter; returns bytes copied. Raises on any gap."""
    from safetensors import safe_open

    targets = weight_targets(model)
    filled: set[int] = set()
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt", device=str(device)) as fh:
            for name in fh.keys():  # noqa: SIM118
                if name not in targets:
                    raise KeyError(f"bundle tensor {name!r} has no place in the model")
                t = fh.get_tensor(name)
                dst = targets[name]
                with torch.no_grad():
                    dst.copy_(t)
                filled.add(id(dst))
                total += t.nbytes
                del t
    missing = [n for n, t in targets.items() if id(t) not in filled]
    if missing:
        raise KeyError(f"bundle is missing weights for {missing[:5]}")
    return total
