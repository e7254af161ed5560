"""Which endpoints an admission captures: the snapshot budget of the seed, as pure functions."""

from __future__ import annotations

from collections.abc import Sequence

MAX_CAPTURES_PER_ADMISSION = 8
# With recurrent state every capture ends a prefill chunk: endpoints closer than this to the
# restored checkpoint or to the prompt's end are not worth an extra execution (select_captures).
RECURRENT_MIN_CAPTURE_GAP = 32


def snapshot_budget(num_snapshot_rows: int, max_concurrency: int) -> int:
    """New captures one admission may make: the snapshot pool divided by the maximum
    concurrency, rounded down and capped at eight; at least one for a nonempty pool, none for an
    empty one."""
    if num_snapshot_rows <= 0:
        return 0
    return max(1, min(MAX_CAPTURES_PER_ADMISSION, num_snapshot_rows // max(1, max_concurrency)))


def select_captures(
    budget: int,
    reused: int,
    prompt_len: int,
    max_tokens: int,
    endpoints: Sequence[int],
    min_gap: int = 1,
) -> tuple[int, ...]:
    """Prefill endpoints (sorted, exact token counts) this admission snapshots.

    One capture of the budget is reserved for the terminal consumed boundary (taken when the
    request leaves, not returned here). When generation can continue beyond the prompt
    (max_tokens > 1), the prompt boundary takes the next one; with a single output token the
    prompt and terminal endpoints coincide. The rest selects message endpoints inside the
    uncached suffix, at least `min_gap` tokens from either end of it (reused + min_gap ..
    prompt_len - min_gap): all of them if they fit, otherwise the eligible endpoint nearest to
    each of `rest` equally spaced targets (ties: the earlier endpoint), deduplicated.

    `min_gap` > 1 is for models whose captures end prefill chunks (recurrent state): there an
    endpoint a few tokens from the restored checkpoint or from the prompt's own checkpoint
    (an agent's message end right after the previous output, a tool result's end before the
    assistant header) would cost a whole extra prefill execution to save a few tokens.
    """
    if budget < 1 or reused >= prompt_len:
        return ()
    rest = budget - 1
    chosen: set[int] = set()
    if max_tokens > 1 and rest >= 1:
        chosen.add(prompt_len)
        rest -= 1
    gap = max(1, min_gap)
    eligible = sorted({e for e in endpoints if reused + gap <= e <= prompt_len - gap})
    if len(eligible) <= rest:
        chosen.update(eligible)
    elif rest > 0:
        span = prompt_len - reused
        for k in range(1, rest + 1):
            # target t = reused + span * k / (rest + 1); compare distances scaled by rest + 1
            scaled = reused * (rest + 1) + span * k
            chosen.add(min(eligible, key=lambda e: (abs(e * (rest + 1) - scaled), e)))
    return tuple(sorted(chosen))
