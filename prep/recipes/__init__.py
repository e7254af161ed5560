"""Recipe registry: recipes register by Transformers architecture class name.

Shared code never branches on a model's name; it asks the registry for the recipe of
`config.architectures[0]` and reads what the recipe declares.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from prep.bundle import (
    Frontend,
    Geometry,
    Layout,
    ReasoningParser,
    SamplingDefaults,
    ToolParser,
)
from prep.errors import UnsupportedModel
from prep.recipes.checkpoints import (
    CheckpointModel,
    SourceLayout,
    Wrapper,
    language_config,
    refuse_quantized,
)


class Recipe(Protocol):
    """What shared preparation code reads from a recipe. Optional hooks, looked up by name:
    `prepare_state_modules(model)` (recurrent layers over the state pool) and
    `source_layout(config) -> SourceLayout` (how the family's published checkpoints name
    their tensors: skipped heads, per-expert tensors of stacked parameters)."""

    name: str

    def validate(self, config: Any) -> None: ...

    def geometry(self, config: Any, page_size: int) -> Geometry: ...

    def sampling_defaults(self, config: Any) -> SamplingDefaults: ...

    def parsers(self, config: Any) -> tuple[ReasoningParser, ToolParser]: ...

    def layout(self, config: Any) -> Layout:
        """The execution layout prep writes and the daemon rebuilds."""
        ...

    def prepare_modules(self, model: Any, layout: Layout) -> None:
        """Module surgery beyond the attention implementation, as `layout` declares."""
        ...


_REGISTRY: dict[str, Callable[[], Recipe]] = {}
_WRAPPERS: dict[str, Wrapper] = {}


def register(*architectures: str) -> Callable[[Callable[[], Recipe]], Callable[[], Recipe]]:
    def deco(factory: Callable[[], Recipe]) -> Callable[[], Recipe]:
        for arch in architectures:
            _REGISTRY[arch] = factory
        return factory

    return deco


def register_wrapper(wrapper: Wrapper) -> Wrapper:
    """A published architecture served through the recipe of the language model it wraps."""
    _WRAPPERS[wrapper.architecture] = wrapper
    return wrapper


def registered_architectures() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted({*_REGISTRY, *_WRAPPERS}))


def resolve(config: Any) -> Recipe:
    """The recipe for a Transformers config, or UnsupportedModel naming the architecture."""
    _load_builtin()
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        raise UnsupportedModel("config.json declares no 'architectures'; cannot choose a recipe")
    arch = archs[0]
    if arch not in _REGISTRY:
        raise UnsupportedModel(
            f"architecture {arch!r} is not supported; supported architectures: "
            f"{', '.join(registered_architectures())}"
        )
    return _REGISTRY[arch]()


def read_checkpoint(config: Any) -> CheckpointModel:
    """The model a checkpoint's config describes, as a recipe prepares it: the language model
    of a registered wrapper (e.g. a vision-language checkpoint served as text), or the model
    itself; with the source layout (renames, skipped and stacked tensors) of both."""
    _load_builtin()
    refuse_quantized(config)
    archs = list(getattr(config, "architectures", None) or [])
    source_arch = archs[0] if archs else ""
    wrapper = _WRAPPERS.get(source_arch)
    model_config = config
    if wrapper is not None:
        model_config = language_config(config, wrapper)
        refuse_quantized(model_config)
    recipe = resolve(model_config)
    layout = wrapper.layout if wrapper is not None else SourceLayout()
    declared = getattr(recipe, "source_layout", None)
    if declared is not None:
        layout = layout + declared(model_config)
    return CheckpointModel(model_config, source_arch, wrapper, layout)


def prepare_state_modules(model: Any) -> None:
    """Let the model's recipe replace its stateful token mixers (e.g. linear-attention layers)
    by prepared modules over the state pool. Unlike `Recipe.prepare_modules` this is not a
    layout choice: a recurrent layer has no correct execution without it. Recipes without
    recurrent layers declare no `prepare_state_modules`."""
    if not getattr(model.config, "architectures", None):
        return
    hook = getattr(resolve(model.config), "prepare_state_modules", None)
    if hook is not None:
        hook(model)


def _load_builtin() -> None:
    from prep.recipes import dense, hybrid  # noqa: F401  (register on import)


__all__ = [
    "CheckpointModel", "Frontend", "Recipe", "SourceLayout", "Wrapper", "prepare_state_modules",
    "read_checkpoint", "register", "register_wrapper", "registered_architectures", "resolve",
]  # fmt: skip
