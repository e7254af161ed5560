"""The shim's text-level stop strings: chunking never changes the output (no daemon needed)."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from libflare_client.http.generation import StopMatcher

ALPHA = st.text(alphabet="abc\u00e9", max_size=30)


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the stop string completed first (earliest end; then the longest)."""
    hits = [(i + len(s), i) for s in stops if s and (i := text.find(s)) >= 0]
    return (text[: min(hits)[1]], True) if hits else (text, False)


@given(
    text=ALPHA,
    stops=st.lists(st.text(alphabet="abc\u00e9", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
)
def test_chunking_is_invisible(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m = StopMatcher(stops)
    out, hit = [], False
    for a, b in pairwise(bounds):
        piece, hit = m.feed(text[a:b])
        out.append(piece)
        if hit:
            break
    if not hit:
        out.append(m.flush())
    assert ("".join(out), hit) == reference(text, stops)


def test_the_stop_completed_first_wins() -> None:
    """'b' completes before 'aba' does, in one chunk or two (generation would stop there)."""
    for chunks in (["aba"], ["ab", "a"]):
        m = StopMatcher(["b", "aba"])
        out = [m.feed(c) for c in chunks]
        assert out[0] == ("a", True) and m.matched == "b"


def test_holds_back_a_partial_stop() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("hello </e") == ("hello ", False)
    assert m.feed("nd> tail") == ("", True)
    m = StopMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", False)
    assert m.feed("x") == ("</ex", False)
