"""How long the next prefill chunk of a prompt is. A pure function, so the rule is testable alone.

Checkpoints sit at exact token endpoints, so a chunk must end exactly at the next endpoint rather
than cross it; endpoints are never rounded to pages or chunk sizes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence


def next_chunk_tokens(
    consumed: int, prompt_len: int, chunk_limit: int, endpoints: Sequence[int]
) -> int:
    """Tokens in the chunk that starts at `consumed`.

    min(chunk_limit, prompt_len - consumed), shortened so that the chunk ends at the first endpoint
    strictly greater than `consumed` if that endpoint lies inside the chunk. `endpoints` must be
    sorted ascending; endpoints at or beyond `prompt_len` never clip. The result is ≥ 1.
    """
    if not 0 <= consumed < prompt_len:
        raise ValueError(f"consumed={consumed} is not inside a prompt of {prompt_len} tokens")
    if chunk_limit < 1:
        raise ValueError(f"chunk_limit must be at least 1, got {chunk_limit}")
    end = min(consumed + chunk_limit, prompt_len)
    i = bisect_right(endpoints, consumed)
    if i < len(endpoints) and endpoints[i] < end:
        end = endpoints[i]
    return end - consumed
