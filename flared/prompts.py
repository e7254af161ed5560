"""Prompt token ids as the engine takes them: every id an integer in the vocabulary, checked
once at submit on the submitting thread (pure CPU)."""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence

import numpy as np

from flared.engine.errors import InvalidRequest

__all__ = ["checked_prompt", "prompt_ids"]


def prompt_ids(prompt: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """The prompt as a tuple of token ids (see `checked_prompt`)."""
    return checked_prompt(prompt, vocab_size)[0]


def checked_prompt(prompt: Sequence[int], vocab_size: int) -> tuple[tuple[int, ...], bytes | None]:
    """The prompt as a tuple of token ids, each checked to be an integer in the vocabulary, or
    InvalidRequest. A list or tuple is checked in one struct packing (every element an integer:
    an int, or an integer type such as numpy's, kept as given) and one numpy range check over the
    packed bytes: ~0.05 ms for 5,000 tokens, where a Python pass per token costs ~0.3 ms on the
    submitting thread. Any other iterable is converted element by element. Second: the ids
    packed as little-endian int64s when the check packed them (None otherwise), which the
    runner uploads without converting 5,000 Python ints again on the engine thread."""
    ids: tuple[int, ...] | None = None
    packed = _packed_ids(prompt) if type(prompt) in (list, tuple) else None
    if packed is not None:
        ids = tuple(prompt)
        arr = np.frombuffer(packed, dtype=np.int64)
        ok = not ids or (int(arr.min()) >= 0 and int(arr.max()) < vocab_size)
    if ids is None:
        try:
            ids = tuple(operator.index(t) for t in prompt)
        except TypeError:
            odd = next(t for t in prompt if not _is_index(t))
            raise InvalidRequest(f"prompt token ids must be integers, got {odd!r}") from None
        ok = not ids or (min(ids) >= 0 and max(ids) < vocab_size)
    if not ok:
        outside = [t for t in ids if not 0 <= t < vocab_size]
        raise InvalidRequest(
            f"prompt token ids {outside[:5]} are outside the vocabulary (0..{vocab_size - 1})"
        )
    return ids, packed


def _packed_ids(prompt: Sequence[int]) -> bytes | None:
    """The ids as little-endian int64s, or None unless every one is an integer that fits."""
    try:
        return struct.pack(f"<{len(prompt)}q", *prompt)
    except struct.error:
        return None


def _is_index(value: object) -> bool:
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
