"""Imported first by the interpreted-kernel scripts (`run_interpreted`): Triton's interpreter, as
it comes, re-patches `triton.language` on every call of a `@triton.jit` helper from inside a
kernel (`InterpretedFunction.__call__` calls `_patch_lang`, which walks the modules with
`inspect.getmembers` and re-wraps their builtins), although the kernel's launch has already
patched them: a third of an interpreted GEMV test's time went there. Inside a launch that patched
the same language modules, such a re-patch changes nothing (the builtins it would wrap are wrapped,
the core members it sets are set to equivalent functions, and it restores nothing), so here it is
skipped; a helper that sees a module the launch did not patch is patched as before. Where the
interpreter's internals differ from these, nothing is changed. `FLARE_TEST_PLAIN_INTERPRETER=1`
leaves the interpreter as it comes."""

from __future__ import annotations

import inspect
import os
from typing import Any


def install() -> bool:
    """Skip the redundant re-patching; False where it is off or the interpreter differs."""
    if os.environ.get("FLARE_TEST_PLAIN_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid_executor = getattr(interpreter, "GridExecutor", None)
    launch = vars(grid_executor).get("__call__") if grid_executor is not None else None
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if grid_executor is None or launch is None or patch_lang is None or scope_type is None:
        return False
    patched: list[set[int] | None] = []  # per launch in progress: the modules it patched
    seen: dict[tuple[int, int], set[int]] = {}  # per globals (and their size): the modules

    def languages(fn: Any) -> set[int]:  # as `_patch_lang` finds them
        key = (id(fn.__globals__), len(fn.__globals__))
        if key not in seen:
            found = fn.__globals__.values()
            seen[key] = {id(v) for v in found if inspect.ismodule(v) and v in [tl, tl.core]}
        return seen[key]

    def patch_once(fn: Any) -> Any:
        if not patched:  # outside a launch: as it comes
            return patch_lang(fn)
        if patched[-1] is None:  # the launch's own patching
            patched[-1] = languages(fn)
            return patch_lang(fn)
        wanted = languages(fn)
        if wanted <= patched[-1]:
            return scope_type()  # nothing to patch, nothing to restore
        patched[-1] |= wanted
        return patch_lang(fn)

    def launch_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_once
    grid_executor.__call__ = launch_once
    return True


install()
