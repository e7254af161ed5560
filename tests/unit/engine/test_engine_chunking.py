import pytest
from hypothesis import given
from hypothesis import strategies as st

from flared.engine.chunking import next_chunk_tokens


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
