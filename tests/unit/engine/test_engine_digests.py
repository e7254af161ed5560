"""Prefix identity (chained 64-token block digests) and the snapshot budget selection."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flared.engine.capture import select_captures, snapshot_budget
from flared.engine.digests import ConditioningInput, PrefixDigests, root_digest

ROOT = root_digest("qwen3-next", "chat-v1")


def test_keys_name_exact_prefixes() -> None:
    tokens = list(range(1000, 1200))
    d = PrefixDigests(ROOT, tokens)
    keys = [d.key(n) for n in range(1, 201)]
    assert len(set(keys)) == 200  # every exact count is its own key, not rounded to a block
    other = PrefixDigests(ROOT, tokens[:130] + [7] * 70)
    assert all(other.key(n) == d.key(n) for n in range(1, 131))  # later tokens do not matter
    assert all(other.key(n) != d.key(n) for n in range(131, 201))
    with pytest.raises(ValueError):
        d.key(0)
    with pytest.raises(ValueError):
        d.key(201)


def test_a_changed_early_token_changes_every_later_key() -> None:
    tokens = list(range(300))
    changed = tokens.copy()
    changed[3] = 9999
    a, b = PrefixDigests(ROOT, tokens), PrefixDigests(ROOT, changed)
    assert a.key(3) == b.key(3)
    assert all(a.key(n) != b.key(n) for n in range(4, 301))


def test_conditioning_identity_separates_models_and_layouts() -> None:
    tokens = [5] * 70
    keys = {
        PrefixDigests(root_digest(m, layout), tokens).key(70)
        for m in ("m1", "m2")
        for layout in ("l1", "l2")
    }
    assert len(keys) == 4


def test_images_enter_the_prefix_at_their_offset() -> None:
    tokens = [1] * 150
    plain = PrefixDigests(ROOT, tokens)
    img_a = PrefixDigests(ROOT, tokens, [ConditioningInput(100, b"image-a")])
    img_b = PrefixDigests(ROOT, tokens, [ConditioningInput(100, b"image-b")])
    for n in (1, 64, 100):  # prefixes ending before the image are unchanged
        assert plain.key(n) == img_a.key(n) == img_b.key(n)
    for n in (101, 128, 150):  # identical text with different images differs
        assert len({plain.key(n), img_a.key(n), img_b.key(n)}) == 3
    again = PrefixDigests(ROOT, tokens, [ConditioningInput(100, b"image-a")])
    assert again.key(150) == img_a.key(150)  # a repeated identical image matches


@given(st.lists(st.integers(0, 2**20), min_size=1, max_size=300), st.data())
def test_incremental_extension_matches_one_shot(tokens: list[int], data: st.DataObject) -> None:
    cut = data.draw(st.integers(0, len(tokens)))
    inc = PrefixDigests(ROOT, tokens[:cut])
    inc.extend(tokens[cut:])
    whole = PrefixDigests(ROOT, tokens)
    n = data.draw(st.integers(1, len(tokens)))
    assert inc.key(n) == whole.key(n)


@given(
    st.lists(st.integers(0, 2**20), min_size=1, max_size=300),
    st.lists(st.integers(0, 2**20), max_size=200),
    st.data(),
)
def test_a_fork_extended_by_other_tokens_matches_one_shot(
    tokens: list[int], suffix: list[int], data: st.DataObject
) -> None:
    """A fork at any cut, extended by different tokens, equals digests computed from scratch,
    and extending it leaves the original untouched."""
    whole = PrefixDigests(ROOT, tokens)
    before = [whole.key(n) for n in range(1, len(tokens) + 1)]
    cut = data.draw(st.integers(0, len(tokens)))
    fork = whole.fork(cut)
    assert len(fork) == cut
    fork.extend(suffix)
    fresh = PrefixDigests(ROOT, tokens[:cut] + suffix)
    assert [fork.key(n) for n in range(1, len(fork) + 1)] == [
        fresh.key(n) for n in range(1, len(fresh) + 1)
    ]
    assert [whole.key(n) for n in range(1, len(tokens) + 1)] == before
    with pytest.raises(ValueError):
        whole.fork(len(tokens) + 1)


def test_a_fork_keeps_only_the_images_before_its_cut() -> None:
    tokens = [1] * 150
    img = PrefixDigests(ROOT, tokens, [ConditioningInput(100, b"image-a")])
    early = img.fork(90)
    early.extend([1] * 60)
    assert early.key(150) == PrefixDigests(ROOT, tokens).key(150)
    late = img.fork(120)
    late.extend([1] * 30)
    assert late.key(150) == img.key(150)


def test_snapshot_budget() -> None:
    assert snapshot_budget(0, 4) == 0  # an empty pool permits none
    assert snapshot_budget(1, 4) == 1  # a nonempty pool permits at least one
    assert snapshot_budget(7, 4) == 1
    assert snapshot_budget(12, 4) == 3
    assert snapshot_budget(36, 4) == 8  # capped at eight
    assert snapshot_budget(100, 1) == 8


def test_select_captures_reserves_terminal_then_prompt() -> None:
    ends = [10, 20, 30, 40]
    assert select_captures(0, 0, 50, 5, ends) == ()
    assert select_captures(1, 0, 50, 5, ends) == ()  # only the terminal capture
    assert select_captures(2, 0, 50, 5, ends) == (50,)  # terminal + prompt
    assert select_captures(2, 0, 50, 1, ends) == (20,)  # one output: prompt == terminal
    assert select_captures(6, 0, 50, 5, ends) == (10, 20, 30, 40, 50)  # all fit
    assert select_captures(8, 25, 50, 5, ends) == (30, 40, 50)  # inside the uncached suffix
    assert select_captures(8, 50, 50, 5, ends) == ()  # a full-prompt hit captures no prefill


def test_select_captures_spreads_targets_ties_to_the_earlier_endpoint() -> None:
    # budget 3: terminal, prompt, one message: target 25 is equidistant from 20 and 30
    assert select_captures(3, 0, 50, 5, [10, 20, 30, 40]) == (20, 50)
    # budget 4: two messages at targets 100/3 and 200/3
    assert select_captures(4, 0, 100, 5, [5, 30, 36, 60, 90]) == (36, 60, 100)
    # nearest boundaries may coincide: deduplicated
    assert select_captures(4, 0, 100, 5, [1, 2, 3]) == (3, 100)  # targets 33, 66
    assert select_captures(5, 0, 100, 5, [50, 51, 52, 53]) == (50, 53, 100)  # targets 25, 50, 75


def test_select_captures_skips_endpoints_near_either_end_of_the_suffix() -> None:
    # an agent turn resumed at its previous output's terminal boundary (351): the assistant
    # message ends one token later, the tool result 11 tokens before the prompt's end
    ends = [352, 652, 700]
    assert select_captures(8, 351, 663, 5, ends) == (352, 652, 663)  # every endpoint
    assert select_captures(8, 351, 663, 5, ends, min_gap=32) == (663,)  # one prefill chunk
    assert select_captures(8, 351, 700, 5, ends, min_gap=32) == (652, 700)
    assert select_captures(8, 0, 100, 5, [31, 32, 68, 69], min_gap=32) == (32, 68, 100)  # bounds
    assert select_captures(8, 0, 100, 1, [31, 32, 68, 69], min_gap=32) == (32, 68)


def test_token_bytes_are_fixed_width_little_endian_for_every_id() -> None:
    from flared.engine.digests import _tokens_bytes

    ids = [0, 1, 255, 256, 151_935, (1 << 63) - 1, 1 << 63, -1]
    assert _tokens_bytes(ids) == b"".join((t % (1 << 64)).to_bytes(8, "little") for t in ids)
    assert _tokens_bytes(ids[:5]) == b"".join(t.to_bytes(8, "little") for t in ids[:5])
    assert _tokens_bytes([]) == b""


def _reference_key(tokens: list[int], inputs: list[ConditioningInput], s: int) -> int:
    """key(S) straight from the module's definition, one `_h` per block."""
    from flared.engine.digests import _h, _inputs_bytes, _tokens_bytes

    d = ROOT
    for b in range(s // 64):
        block = tokens[64 * b : 64 * b + 64]
        d = _h(d.to_bytes(16, "little"), _tokens_bytes(block),
               _inputs_bytes(inputs, 64 * b, 64 * b + 64))  # fmt: skip
    lo = s // 64 * 64
    return _h(d.to_bytes(16, "little"), s.to_bytes(8, "little"), _tokens_bytes(tokens[lo:s]),
              _inputs_bytes(inputs, lo, s))  # fmt: skip


@given(
    tokens=st.lists(st.integers(0, 2**40), min_size=1, max_size=300),
    cuts=st.lists(st.integers(1, 300), max_size=4),
    offsets=st.sets(st.integers(0, 299), max_size=3),
)
def test_digests_equal_the_definition_however_they_are_extended(
    tokens: list[int], cuts: list[int], offsets: set[int]
) -> None:
    """Block digests are built in batches per extend; keys equal the one-block-at-a-time
    definition for any split of the sequence into extends, with and without images."""
    inputs = [ConditioningInput(o, bytes([o % 256]) * 3) for o in sorted(offsets)]
    d = PrefixDigests(ROOT, (), inputs)
    at = 0
    for cut in [*sorted(cuts), len(tokens)]:
        cut = min(cut, len(tokens))
        d.extend(tokens[at:cut])
        at = max(at, cut)
    for s in {1, len(tokens), *(c for c in cuts if c <= len(tokens)), min(64, len(tokens))}:
        assert d.key(s) == _reference_key(tokens, inputs, s)
