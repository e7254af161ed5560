"""Published checkpoint layouts: how a checkpoint's config and tensor names map onto the model a
recipe prepares.

A checkpoint as published can differ from the Transformers model Flare prepares in two ways,
both declared as data here and applied by shared code (`prep.weights.plan_tensors`):

- A wrapper architecture around a registered language model, e.g. a vision-language
  `…ForConditionalGeneration` served as text only: the language model is prepared from the
  wrapper's `text_config`, its tensors are renamed into the language model's names, and the
  other towers are listed as deliberately not loaded (`Wrapper`).
- Tensors the model keeps stacked but the checkpoint stores one per index, e.g. MoE experts
  (`Stacked`): each source tensor is written into its slice of the stacked parameter.

Rules never drop a tensor silently: every source tensor is stored, written into a slice, or
reported under a reason (`Skip`) in the manifest.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prep.errors import UnsupportedModel


@dataclass(frozen=True)
class Skip:
    """Source tensors whose name matches `pattern` (a regex, searched) are deliberately not
    loaded; `reason` is reported in the manifest next to their names."""

    pattern: str
    reason: str


@dataclass(frozen=True)
class StackedPart:
    """Where one per-index source tensor goes: rows `chunk` of `chunks` (dim 0) of index `i`
    of the stacked parameter `{stack}.{param}`."""

    param: str
    chunk: int = 0
    chunks: int = 1


@dataclass(frozen=True)
class Stacked:
    """Per-index source tensors that fill slices of stacked model parameters.

    A (renamed) source name matching `pattern`, with named groups `stack`, `index` and `part`,
    fills `{stack}.{parts[part].param}[index]`, rows chunk/chunks of its dim 0. Every such
    slice is a contiguous block of the stacked parameter, so conversion writes each source
    tensor at its own offset and never assembles the stacked tensor in memory.
    """

    pattern: str
    parts: Mapping[str, StackedPart]
    unit: str  # what one index is, for messages ("expert")


@dataclass(frozen=True)
class SourceLayout:
    """Every difference between checkpoint tensor names and the model's parameter names."""

    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement), in order, on source names
    skip: tuple[Skip, ...] = ()
    stacked: tuple[Stacked, ...] = ()

    def __add__(self, other: SourceLayout) -> SourceLayout:
        return SourceLayout(
            self.renames + other.renames, self.skip + other.skip, self.stacked + other.stacked
        )

    def skip_reason(self, name: str) -> str | None:
        for s in self.skip:
            if re.search(s.pattern, name):
                return s.reason
        return None

    def rename(self, name: str) -> str:
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name


@dataclass(frozen=True)
class Wrapper:
    """A published architecture wrapping a registered language model that Flare serves alone."""

    architecture: str  # as the checkpoint's config.json declares it
    language_architecture: str  # the registered recipe's architecture (a …ForCausalLM)
    layout: SourceLayout  # renames into the language model's names, skipped towers
    sub_config: str = "text_config"


@dataclass(frozen=True)
class CheckpointModel:
    """What preparation reads from a checkpoint: the model config a recipe prepares, the
    source layout to apply to its tensors, and where both came from."""

    config: Any  # the language model's Transformers config (architectures set)
    source_architecture: str
    wrapper: Wrapper | None = None
    layout: SourceLayout = field(default_factory=SourceLayout)


def language_config(config: Any, wrapper: Wrapper) -> Any:
    """The wrapped language model's config, standing alone as the text-only checkpoint's would.

    The wrapper's own `tie_word_embeddings` decides tying: Transformers ties the published
    class's head by the top-level flag, whatever the sub-config says."""
    sub = getattr(config, wrapper.sub_config, None)
    if sub is None:
        raise UnsupportedModel(
            f"{wrapper.architecture} checkpoint declares no {wrapper.sub_config}; "
            "cannot prepare its language model"
        )
    text = copy.deepcopy(sub)
    text.architectures = [wrapper.language_architecture]
    text.tie_word_embeddings = bool(
        getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    )
    for key in ("dtype", "eos_token_id"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def refuse_quantized(config: Any) -> None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", qc)
    raise UnsupportedModel(
        f"quantized checkpoints are not supported (quantization_config.quant_method = "
        f"{method!r}); prepare the unquantized BF16/FP16/FP32 checkpoint"
    )
