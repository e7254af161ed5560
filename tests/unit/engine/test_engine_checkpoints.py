"""The checkpoint store alone: chains, publication, thinning, eviction and fences."""

import pytest

from flared.engine.checkpoints import Checkpoint, CheckpointStore
from flared.engine.digests import PrefixDigests, root_digest
from flared.engine.plan import NO_PAGE
from flared.engine.resources import ResourceManager

P = 4
TOKENS = list(range(500, 700))
DIGESTS = PrefixDigests(root_digest("m", "t"), TOKENS)


class Fixture:
    def __init__(self, num_pages: int = 64, num_snapshots: int = 16) -> None:
        self.res = ResourceManager(num_pages, P, 2, num_snapshots)
        self.store = CheckpointStore(self.res)

    def make(
        self, parent: Checkpoint | None, num_tokens: int, *, publish: bool = True, fence: int = -1
    ) -> Checkpoint:
        """A checkpoint of TOKENS[:num_tokens] whose segment pages are fresh."""
        first = parent.num_tokens // P if parent else 0
        segment = [self.res.alloc_page() for _ in range(num_tokens // P - first)]
        tail = self.res.alloc_page() if num_tokens % P else NO_PAGE
        snapshot = self.res.alloc_snapshot()
        assert None not in segment and tail is not None and snapshot is not None
        pages = [p for p in segment if p is not None]
        ckpt = self.store.begin(
            DIGESTS.key(num_tokens), num_tokens, parent, pages, tail, snapshot, fence
        )
        for p in pages:  # the computing request leaves: the checkpoint keeps the pages
            self.res.decref(p, -1)
        if publish:
            assert self.store.publish(ckpt)
        self.check()
        return ckpt

    def check(self) -> None:
        refs, snaps = self.store.check_integrity()
        self.res.check_integrity([], refs, snaps)

    def keys(self) -> set[int]:
        return {c.num_tokens for c in self.store.checkpoints()}


def test_chain_pages_concatenate_segments_and_lookup_finds_the_longest() -> None:
    f = Fixture()
    a = f.make(None, 6)  # pages [0], tail
    b = f.make(a, 13)  # pages 1, 2 (index 1, 2), tail
    c = f.make(b, 16)  # page index 3, no tail
    assert len(f.store.chain_pages(c)) == 4 and f.store.chain_pages(b) == f.store.chain_pages(c)[:3]
    assert f.store.lookup(DIGESTS, 200) is c
    assert f.store.lookup(DIGESTS, 15) is b
    assert f.store.lookup(DIGESTS, 5) is None
    other = PrefixDigests(root_digest("m", "t"), TOKENS[:10] + [0] * 10)
    assert f.store.lookup(other, 20) is a  # diverges at token 10: only a's 6 tokens match


def test_thinning_removes_the_shortest_interval_interior_checkpoint() -> None:
    f = Fixture()
    root = f.make(None, 8)
    a = f.make(root, 12)
    b = f.make(a, 14)
    c = f.make(b, 40)
    chain_c = f.store.chain_pages(c)
    # a: neighbours 8..14 (6 tokens); b: 12..40 (28); root would be 0..12 but roots come last
    assert f.store.evict_for_snapshot()
    assert f.keys() == {8, 14, 40}
    assert b.parent is root and f.store.chain_pages(c) == chain_c  # descendants stay valid
    assert f.store.lookup(PrefixDigests(root_digest("m", "t"), TOKENS[:13]), 13) is root
    f.check()
    assert f.store.evict_for_snapshot()  # b: 8..40, interior
    assert f.keys() == {8, 40}
    assert f.store.evict_for_snapshot()  # only the root has one child now
    assert f.keys() == {40} and c.parent is None and f.store.chain_pages(c) == chain_c
    assert f.store.evict_for_snapshot()  # nothing to thin: the least recently used leaf
    assert f.keys() == set()
    f.check()
    assert f.res.pages.num_free == 64 and f.res.snapshots.num_free == 16


def test_thinning_prefers_the_shorter_interval_over_recency() -> None:
    f = Fixture()
    r = f.make(None, 4)
    x = f.make(r, 8)
    f.make(x, 12)  # x delimits 4..12 (8 tokens)
    y = f.make(r, 9)
    f.make(y, 13)  # y delimits 4..13 (9 tokens); r has two children: never thinned
    f.store.touch(x)  # x is the most recently used, and still the one thinned
    assert f.store.evict_for_snapshot() and x not in f.store.checkpoints()
    f.check()


def test_equal_intervals_break_by_least_recent_access() -> None:
    f = Fixture()
    r = f.make(None, 4)
    x = f.make(r, 8)
    f.make(x, 12)
    r2 = f.make(r, 5)  # r branches (2 children): not thinnable
    f.store.pin(r2)  # a request pins r2: not thinnable either
    y = f.make(r2, 9)
    f.make(y, 13)  # x: 4..12 (8); y: 5..13 (8) -> tie
    f.store.touch(x)  # y is now the least recently used
    assert f.store.evict_for_snapshot() and y not in f.store.checkpoints()
    f.check()
    f.store.touch(x)
    assert f.store.evict_for_snapshot() and x not in f.store.checkpoints()


def test_pins_and_branches_block_thinning_and_eviction() -> None:
    f = Fixture()
    r = f.make(None, 4)
    a = f.make(r, 8)
    f.make(r, 9)  # r has two children
    f.store.pin(a)
    leaf = f.make(a, 12)
    f.store.pin(leaf)
    # r: two children; a: pinned; leaves: pinned (leaf) and the 9-token one
    assert f.store.evict_for_snapshot()
    assert f.keys() == {4, 8, 12}
    assert f.store.evict_for_snapshot()  # now r has one child (a) and no pin: a root to thin
    assert f.keys() == {8, 12}
    assert not f.store.evict_for_snapshot()  # a and leaf are pinned
    f.store.unpin(a)
    f.store.unpin(leaf)
    assert f.store.evict_all() == 2 and len(f.store) == 0
    f.check()
    with pytest.raises(ValueError):
        f.store.unpin(a)


def test_page_pressure_evicts_only_what_gives_pages_back() -> None:
    f = Fixture(num_pages=16)
    aligned = f.make(None, 8)  # two pages, no tail
    old = f.make(None, 3)
    live = f.store.chain_pages(aligned)
    for p in live:  # a live request maps them: evicting `aligned` would free nothing
        f.res.incref(p)
    f.store.touch(aligned)  # `aligned` is now the least recently used, `old` next
    f.store.touch(old)
    free = f.res.pages.num_free
    assert f.store.evict_for_pages()
    assert old not in f.store.checkpoints() and f.res.pages.num_free == free + 1
    assert not f.store.evict_for_pages()  # `aligned` frees no page while the request maps it
    for p in live:
        f.res.decref(p, -1)
    f.check()
    assert f.store.evict_for_pages() and len(f.store) == 0
    f.check()


def test_duplicates_and_discards_release_only_their_own_storage() -> None:
    f = Fixture()
    a = f.make(None, 6)
    dup = f.make(None, 6, publish=False)
    assert not f.store.publish(dup)
    assert f.store.lookup(DIGESTS, 6) is a and f.store.num_duplicates == 1
    pending = f.make(a, 9, publish=False)
    child = f.make(pending, 14, publish=False)
    chain = f.store.chain_pages(child)
    f.store.discard(pending)  # bypassed: the pending child keeps its chain
    assert child.parent is a and f.store.chain_pages(child) == chain
    assert f.store.publish(child)
    f.check()


def test_retired_ids_wait_for_their_fence() -> None:
    f = Fixture(num_pages=8, num_snapshots=1)
    a = f.make(None, 6, fence=5)
    f.res.step_completed(3)
    assert f.store.evict_for_snapshot()
    assert f.res.snapshots.num_free == 0 and f.res.pages.num_free == 6  # still fenced
    f.check()
    f.res.step_completed(5)
    assert f.res.snapshots.num_free == 1 and f.res.pages.num_free == 8
    assert a not in f.store.checkpoints()
    f.check()


def test_begin_validates_geometry() -> None:
    f = Fixture()
    snap = f.res.alloc_snapshot()
    assert snap is not None
    with pytest.raises(ValueError, match="segment"):
        f.store.begin(1, 8, None, [], NO_PAGE, snap, -1)
    with pytest.raises(ValueError, match="tail"):
        f.store.begin(1, 2, None, [], NO_PAGE, snap, -1)
