"""How long the next prefill chunk of a prompt is. Pure functions, so the rules are testable alone.

Checkpoints sit at exact token endpoints, so a chunk must end exactly at the next endpoint rather
than cross it; endpoints are never rounded to pages or chunk sizes.

Prefill runs at a few prepared capacities and a chunk costs its whole capacity: 2,098 tokens in
one chunk of 4,096 cost almost twice 2,048 + 128. With the measured time of each capacity
(`ChunkCosts`) a segment is cut into the chunks of least total time instead of the longest ones.

The measured times leave the attention out (the runner times each capacity's replay on its
captured inputs). That is right for comparing cuts, since a segment's query-key pairs are the
same however it is cut, but it leaves near-ties: on an H100 the 8B shape's 4,096 capacity timed
81.41 ms and its 2,048 40.41, so a 4,096-token prompt went 2,048 + 2,048 in one engine and in
one chunk in another (`benchmarks/results/2026-12-06-h100-decode-ttft-qwen3-8b-compiled-fresh.jsonl`).
What the times do not count is per chunk (each chunk is a step of its own; a first chunk that
fills its capacity takes the fused `prefill{C}_fresh` attention), so each chunk is charged
CHUNK_OVERHEAD of the largest capacity's time as well: a cut must save more than that per
extra chunk.

The attention does differ in one place: a chunk that starts its prompt and fills at least 7/8 of
its capacity runs `prefill{C}_fresh`, whose fused attention over its own keys is faster per
query-key pair than the paged kernel that every later chunk runs. So cutting a prompt moves
pairs from the fused kernel to the paged one: on an H100 the 8B shape's 4,096-token prompt took
99.2 ms in one fresh chunk and 100.4 / 103.3 ms cut 2,048 + 2,048, in engines whose timings had
made that cut by a fraction of a millisecond
(`benchmarks/results/2026-12-06-h100-decode-ttft-qwen3-8b-topk-levels.jsonl`). The runner
measures, per fresh capacity, what a fresh chunk saves against the paged execution on the same
causal chunk (`fresh_bonus`: capacity, the fewest tokens that take it, milliseconds), and the
first chunk of a prompt is chosen with that saving counted (`ChunkCosts.first_chunk_of_prompt`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from itertools import pairwise
from math import inf

CHUNK_OVERHEAD = 0.01  # each chunk is charged 1% of the largest capacity's time


class ChunkCosts:
    """The first chunk of the cheapest way to prefill a segment of r tokens, given the cost
    (device time) of one execution at each prepared capacity.

    A chunk of n tokens costs what the smallest capacity holding n costs (the runner's choice),
    plus `overhead` times the largest capacity's cost. Exact dynamic programming over r up to
    twice the largest capacity; a longer segment starts with a full chunk of the capacity with
    the least cost per token. On equal cost the longer chunk comes first.
    """

    def __init__(
        self,
        costs: Sequence[tuple[int, float]],
        overhead: float = CHUNK_OVERHEAD,
        fresh_bonus: Sequence[tuple[int, int, float]] = (),
    ) -> None:
        if not 0 <= overhead < 1:
            raise ValueError(f"the per-chunk overhead must be in [0, 1), got {overhead}")
        caps = sorted(costs)
        if not caps or any(c < 1 or not t > 0 for c, t in caps):
            raise ValueError(f"chunk costs need positive capacities and times, got {list(costs)}")
        if any(a[0] == b[0] for a, b in pairwise(caps)):
            raise ValueError(f"chunk costs name a capacity twice: {list(costs)}")
        # a larger capacity does more work than a smaller one: a measured time below a smaller
        # capacity's is noise and is raised to it (non-decreasing costs make the cut below exact)
        for i in range(1, len(caps)):
            caps[i] = (caps[i][0], max(caps[i][1], caps[i - 1][1]))
        self.largest = caps[-1][0]
        horizon = 2 * self.largest
        self.costs = tuple(caps)
        self._charge = overhead * caps[-1][1]
        self._best = [0.0] * (horizon + 1)  # the least charged total (time + per-chunk charge)
        spent = [0.0] * (horizon + 1)  # the device time of that plan
        first = [0] * (horizon + 1)
        # a chunk of n tokens runs at the smallest capacity holding it (as the runner does)
        self._run_cost = [0.0] * (self.largest + 1)
        for n in range(1, self.largest + 1):
            self._run_cost[n] = caps[bisect_left(caps, (n, -inf))][1]
        for r in range(1, horizon + 1):
            self._best[r], first[r] = self._cheapest_first(r)
            spent[r] = self._run_cost[first[r]] + spent[r - first[r]]
        self._spent = spent
        self._first = first
        self.best_rate = min(caps, key=lambda ct: (ct[1] / ct[0], -ct[0]))[0]
        known = {c for c, _ in caps}
        self.fresh_bonus: dict[int, tuple[int, float]] = {}
        for cap, least, ms in fresh_bonus:
            if cap not in known or not 0 < least <= cap or ms < 0 or cap in self.fresh_bonus:
                raise ValueError(
                    f"a fresh bonus needs a costed capacity, 0 < tokens <= it, a time >= 0 and "
                    f"one entry per capacity: got {list(fresh_bonus)}"
                )
            self.fresh_bonus[cap] = (least, ms)

    def first_chunk(self, r: int) -> int:
        """Tokens in the first chunk of a segment of r >= 1 tokens."""
        if r < 1:
            raise ValueError(f"a segment has at least one token, got {r}")
        return self._first[r] if r < len(self._first) else self.best_rate

    def first_chunk_of_prompt(self, r: int) -> int:
        """Tokens in the first chunk of a segment of r >= 1 tokens that starts its prompt: as
        `first_chunk`, with each fresh-eligible first chunk (n tokens at a capacity C with a
        bonus, n at least its fewest tokens) credited with what the fresh execution saves. The
        rest of the segment is cut as `first_chunk` cuts it; on equal cost the longer chunk."""
        if not self.fresh_bonus or r > len(self._best) - 1:
            return self.first_chunk(r)
        if r < 1:
            raise ValueError(f"a segment has at least one token, got {r}")
        return self._cheapest_first(r, fresh=True)[1]

    def _cheapest_first(self, r: int, fresh: bool = False) -> tuple[float, int]:
        """(least charged total, its first chunk) of a segment of r tokens whose remainder is
        cut as planned (`_best`, filled up to r - 1); `fresh`: a first chunk that takes a fresh
        execution is credited with its bonus."""
        best_total, best_n = inf, 0
        for cap, _ in self.costs:  # ascending: `<=` lets the longer chunk win a tie
            n = min(cap, r)
            total = self._run_cost[n] + self._charge + self._best[r - n]
            if fresh:
                run_at = self.costs[bisect_left(self.costs, (n, -inf))][0]
                least, ms = self.fresh_bonus.get(run_at, (run_at + 1, 0.0))
                total -= ms if n >= least else 0.0
            if total <= best_total:
                best_total, best_n = total, n
        return best_total, best_n

    def total(self, r: int) -> float:
        """The device time of the planned cut of a segment of r tokens (r up to twice the
        largest capacity): the cut of least device time plus per-chunk charge."""
        return self._spent[r]


def next_chunk_tokens(
    consumed: int,
    prompt_len: int,
    chunk_limit: int,
    endpoints: Sequence[int],
    costs: ChunkCosts | None = None,
) -> int:
    """Tokens in the chunk that starts at `consumed`.

    The segment runs from `consumed` to the first endpoint strictly greater than `consumed`, or
    to `prompt_len` (endpoints at or beyond `prompt_len` never clip). Without `costs` the chunk
    is min(chunk_limit, segment); with them it is the first chunk of the segment's cheapest cut
    (a prompt's first chunk with its fresh execution's saving counted), never longer than
    `chunk_limit`. `endpoints` must be sorted ascending; the result is >= 1.
    """
    if not 0 <= consumed < prompt_len:
        raise ValueError(f"consumed={consumed} is not inside a prompt of {prompt_len} tokens")
    if chunk_limit < 1:
        raise ValueError(f"chunk_limit must be at least 1, got {chunk_limit}")
    end = prompt_len
    i = bisect_right(endpoints, consumed)
    if i < len(endpoints) and endpoints[i] < end:
        end = endpoints[i]
    segment = end - consumed
    if costs is None:
        n = segment
    elif consumed == 0:
        n = costs.first_chunk_of_prompt(segment)
    else:
        n = costs.first_chunk(segment)
    return min(n, chunk_limit)
