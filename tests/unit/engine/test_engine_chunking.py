import math
from functools import cache

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flared.engine.chunking import ChunkCosts, next_chunk_tokens


def test_no_endpoints_takes_the_limit_or_the_rest() -> None:
    assert next_chunk_tokens(0, 10, 4, ()) == 4
    assert next_chunk_tokens(8, 10, 4, ()) == 2
    assert next_chunk_tokens(0, 3, 4, ()) == 3


def test_clips_at_the_next_endpoint_exactly() -> None:
    assert next_chunk_tokens(0, 100, 64, [5, 70]) == 5
    assert next_chunk_tokens(5, 100, 64, [5, 70]) == 64  # an endpoint at `consumed` is behind us
    assert next_chunk_tokens(69, 100, 64, [5, 70]) == 1
    assert next_chunk_tokens(70, 100, 64, [5, 70]) == 30


def test_endpoint_at_or_beyond_the_chunk_end_does_not_clip() -> None:
    assert next_chunk_tokens(0, 100, 8, [8]) == 8
    assert next_chunk_tokens(0, 100, 8, [9]) == 8
    assert next_chunk_tokens(0, 6, 8, [6, 7]) == 6


@pytest.mark.parametrize(("consumed", "prompt_len", "limit"), [(-1, 4, 1), (4, 4, 1), (0, 4, 0)])
def test_rejects_impossible_arguments(consumed: int, prompt_len: int, limit: int) -> None:
    with pytest.raises(ValueError):
        next_chunk_tokens(consumed, prompt_len, limit, ())


@given(
    prompt_len=st.integers(1, 300),
    limit=st.integers(1, 64),
    raw_endpoints=st.sets(st.integers(1, 299), max_size=12),
)
def test_chunks_tile_the_prompt_and_stop_at_every_endpoint(
    prompt_len: int, limit: int, raw_endpoints: set[int]
) -> None:
    endpoints = sorted(e for e in raw_endpoints if e < prompt_len)
    boundaries = []
    consumed = 0
    while consumed < prompt_len:
        n = next_chunk_tokens(consumed, prompt_len, limit, endpoints)
        assert 1 <= n <= limit
        end = consumed + n
        # No endpoint strictly inside the chunk; a short chunk ends at an endpoint or the prompt.
        assert not any(consumed < e < end for e in endpoints)
        assert n == limit or end == prompt_len or end in endpoints
        boundaries.append(end)
        consumed = end
    assert consumed == prompt_len
    assert set(endpoints) <= set(boundaries)


# device times (ms) of a Qwen3.5-2B-shaped hybrid's prefill executions on an H200
H200_HYBRID = [(128, 4.81), (256, 5.36), (384, 6.58), (512, 7.08), (1024, 10.39), (2048, 17.45),
               (4096, 34.59)]  # fmt: skip


def test_costs_cut_a_prompt_just_past_a_capacity_into_two_chunks() -> None:
    costs = ChunkCosts(H200_HYBRID)
    # 2,098 tokens: 2,048 + 50 (17.45 + 4.81 ms) beats one chunk of 4,096 (34.59 ms)
    assert costs.first_chunk(2098) == 2048
    assert next_chunk_tokens(2048, 2098, 4096, (), costs) == 50
    assert costs.total(2098) == pytest.approx(17.45 + 4.81)
    # an appended turn of 312 tokens: one chunk of 384 beats 256 + 128
    assert costs.first_chunk(312) == 312
    # full chunks first, then the cheapest cut of the rest
    assert next_chunk_tokens(0, 9000, 4096, (), costs) == 4096
    assert costs.first_chunk(4097) == 4096
    assert costs.best_rate == 4096 and costs.first_chunk(10**6) == 4096


def test_costs_respect_the_limit_and_endpoints() -> None:
    costs = ChunkCosts(H200_HYBRID)
    assert next_chunk_tokens(0, 2098, 1024, (), costs) == 1024
    # the segment ends at the endpoint and is cut on its own
    assert next_chunk_tokens(0, 5000, 4096, (2098,), costs) == 2048
    assert next_chunk_tokens(2048, 5000, 4096, (2098,), costs) == 50
    assert next_chunk_tokens(0, 5000, 4096, (600,), costs) == 600  # 1,024 beats 512 + 128


def test_a_near_tie_takes_fewer_chunks() -> None:
    """The 8B shape's startup costs on an H100: 2 x 2,048 (80.82 ms) against one 4,096 chunk
    (81.41): a cut that saves 0.7% of the time does not split a 4,096-token prompt (each chunk
    is charged 0.81 ms, 1% of the largest capacity's time); one that saves more does."""
    h100_8b = [(512, 11.10), (1024, 21.27), (2048, 40.41), (4096, 81.41)]
    costs = ChunkCosts(h100_8b)
    assert costs.first_chunk(4096) == 4096 and costs.total(4096) == pytest.approx(81.41)
    assert ChunkCosts(h100_8b, overhead=0.0).first_chunk(4096) == 2048  # the least, exactly
    assert costs.first_chunk(8192) == 4096
    assert costs.first_chunk(2100) == 2048  # 2,048 + 52: 51.51 against 81.41 ms
    assert costs.total(2100) == pytest.approx(40.41 + 11.10)
    with pytest.raises(ValueError, match="overhead"):
        ChunkCosts(h100_8b, overhead=1.0)


def test_equal_costs_prefer_the_longer_chunk() -> None:
    costs = ChunkCosts([(4, 1.0), (8, 1.0)])
    assert costs.first_chunk(8) == 8
    assert costs.first_chunk(5) == 5


@pytest.mark.parametrize(
    "bad", [[], [(0, 1.0)], [(4, 0.0)], [(4, -1.0)], [(4, 1.0), (4, 2.0)], [(4, math.nan)]]
)
def test_costs_reject_bad_tables(bad: list[tuple[int, float]]) -> None:
    with pytest.raises(ValueError):
        ChunkCosts(bad)
    with pytest.raises(ValueError):
        ChunkCosts([(4, 1.0)]).first_chunk(0)


def test_costs_that_fall_with_capacity_are_raised() -> None:
    costs = ChunkCosts([(8, 2.0), (4, 3.0), (16, 5.0)])
    assert costs.costs == ((4, 3.0), (8, 3.0), (16, 5.0))
    assert costs.first_chunk(8) == 8


@given(
    table=st.dictionaries(st.integers(1, 24), st.integers(1, 50), min_size=1, max_size=4).map(
        lambda d: dict(zip(sorted(d), sorted(d.values()), strict=True))  # non-decreasing
    ),
    r=st.integers(1, 60),
)
def test_costs_match_an_exhaustive_search(table: dict[int, int], r: int) -> None:
    """Up to twice the largest capacity, the planned cut (first chunk, then the plan of the
    rest) costs what the cheapest of all cuts costs. Integer costs keep the comparison exact."""
    caps = sorted(table.items())
    r = min(r, 2 * caps[-1][0])

    def run_cost(n: int) -> int:  # the runner picks the smallest capacity holding n
        return min((c, t) for c, t in caps if c >= n)[1]

    @cache
    def cheapest(n: int) -> int:
        if n == 0:
            return 0
        return min(run_cost(k) + cheapest(n - k) for k in range(1, min(n, caps[-1][0]) + 1))

    def plan(costs: ChunkCosts) -> tuple[int, int]:  # (time spent, chunks) cutting r
        spent, left, chunks = 0, r, 0
        while left:
            n = costs.first_chunk(left)
            assert 1 <= n <= left
            spent, left, chunks = spent + run_cost(n), left - n, chunks + 1
        return spent, chunks

    assert plan(ChunkCosts([(c, float(t)) for c, t in caps], overhead=0.0))[0] == cheapest(r)
    # with a per-chunk charge h: the least of time + h x chunks over all cuts (h = 1/2 of an
    # integer cost unit keeps the comparison exact)
    largest_cost = caps[-1][1]
    h = 0.5

    @cache
    def charged(n: int) -> float:
        if n == 0:
            return 0.0
        return min(run_cost(k) + h + charged(n - k) for k in range(1, min(n, caps[-1][0]) + 1))

    spent, chunks = plan(ChunkCosts([(c, float(t)) for c, t in caps], overhead=h / largest_cost))
    assert spent + h * chunks == charged(r)


def test_a_prompts_first_chunk_counts_what_its_fresh_execution_saves() -> None:
    """The 8B shape on an H100, where one engine's startup costs made a 4,096-token prompt go
    2,048 + 2,048 (80.82 against 81.41 ms, 0.6 ms apart: here with the per-chunk charge off)
    and that cut served it in 100.4-103.3 ms against 99.2 in one fresh chunk. With what the
    fresh executions save (2.6 ms at 4,096, 0.6 at 2,048, each from 7/8 of its capacity) the
    prompt's first chunk takes the whole prompt; later chunks, a segment too short for the fresh
    execution and a chunk that does not start its prompt are cut as before."""
    h100_8b = [(512, 11.10), (1024, 21.27), (2048, 40.41), (4096, 81.41)]
    bonus = [(2048, 1792, 0.6), (4096, 3584, 2.6)]
    plain = ChunkCosts(h100_8b, overhead=0.0)
    costs = ChunkCosts(h100_8b, overhead=0.0, fresh_bonus=bonus)
    assert plain.first_chunk_of_prompt(4096) == plain.first_chunk(4096) == 2048
    assert costs.first_chunk_of_prompt(4096) == 4096
    assert costs.first_chunk(4096) == 2048  # mid-prompt: no fresh execution there
    assert costs.first_chunk_of_prompt(3000) == costs.first_chunk(3000)  # 3,000 < 3,584
    assert costs.first_chunk_of_prompt(10_000) == costs.first_chunk(10_000)  # past the table
    assert next_chunk_tokens(0, 4096, 4096, (), costs) == 4096
    assert next_chunk_tokens(0, 5000, 4096, (4096,), costs) == 4096  # to the endpoint
    assert next_chunk_tokens(100, 4196, 4096, (), costs) == 2048  # a restored prefix
    # a saving smaller than the cut's gains nothing: the cheaper cut stays
    small = ChunkCosts(h100_8b, overhead=0.0, fresh_bonus=[(4096, 3584, 0.1)])
    assert small.first_chunk_of_prompt(4096) == 2048


@pytest.mark.parametrize(
    "bonus",
    [[(3000, 10, 1.0)], [(4096, 0, 1.0)], [(4096, 4097, 1.0)], [(4096, 10, -1.0)],
     [(4096, 10, 1.0), (4096, 20, 2.0)]],
)  # fmt: skip
def test_fresh_bonuses_name_costed_capacities_once(bonus: list[tuple[int, int, float]]) -> None:
    with pytest.raises(ValueError, match="fresh bonus"):
        ChunkCosts([(2048, 40.0), (4096, 81.0)], fresh_bonus=bonus)
