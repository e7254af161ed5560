import pytest

from flared.engine.plan import RequestParams
from flared.engine.request import Request


def test_history_range_is_the_slice_of_prompt_plus_outputs() -> None:
    req = Request(0, "a", (1, 2, 3, 4), RequestParams(), ())
    req.output_token_ids = [5, 6, 7]
    full = (1, 2, 3, 4, 5, 6, 7)
    for start in range(8):
        for end in range(start, 8):
            got = req.history_range(start, end)
            assert got == full[start:end] and type(got) is tuple
    assert req.history(4) is req.prompt_token_ids  # the whole prompt: no copy
    assert req.history(6) == full[:6]
    with pytest.raises(ValueError, match="no history of 8"):
        req.history_range(0, 8)
