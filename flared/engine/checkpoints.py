"""The checkpoint store: immutable, content-addressed checkpoints in parent-linked page chains.

A checkpoint of S tokens (P = page size) owns:

    segment     its complete pages at page indices first_page .. S // P - 1, where first_page
                = parent.num_tokens // P (0 for a root); the chain of a checkpoint is the
                concatenation of the segments from its root down, exactly S // P pages, in
                physical page order of the request that computed them. Complete pages are
                immutable and shared with live requests that map them.
    tail_page   the whole physical page holding positions S // P * P .. S - 1 when S % P != 0
                (NO_PAGE otherwise); a restore copies it into a private page.
    snapshot    the snapshot row with the rest of the continuation state (recurrent state,
                convolution histories, positions, saved final hidden vector).

It holds one page reference per segment page and one for its tail page. A checkpoint is
*pending* from the plan that snapshots it until that step completes, then *published* (visible
to lookups) or discarded (a duplicate key was published meanwhile). A pending checkpoint that
cannot be discarded may already serve admissions planned in later steps (`lookup_pending`).
`num_pins` counts direct request pins (a request pins the deepest checkpoint of its own chain);
`fence` is the newest step that used its snapshot row or tail page.

Retirement never invalidates descendants: removing an ancestor with one child moves its segment
to the front of the child's segment and links the child to its grandparent (`_bypass`); only
leaves give their segment pages back (`_drop_leaf`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from flared.engine.digests import PrefixDigests
from flared.engine.plan import NO_PAGE
from flared.engine.resources import ResourceManager


@dataclass(eq=False)
class Checkpoint:
    cid: int
    key: int
    num_tokens: int
    parent: Checkpoint | None
    segment: list[int]
    tail_page: int
    snapshot: int
    fence: int
    children: list[Checkpoint] = field(default_factory=list)
    num_pins: int = 0
    last_access: int = 0
    published: bool = False
    # False for a capture inside a chunk: the snapshot's hidden vector is a later token's
    has_hidden: bool = True
    # the step whose snapshot op writes it: any later step may restore from it, published or
    # not (steps execute in step order on one stream)
    step: int = -1

    def __repr__(self) -> str:
        return f"Checkpoint({self.cid}, {self.num_tokens} tokens)"


class CheckpointStore:
    def __init__(self, resources: ResourceManager) -> None:
        self._res = resources
        self.page_size = resources.page_size
        self._all: dict[int, Checkpoint] = {}
        self._pending: dict[int, Checkpoint] = {}  # not published yet (a few, whatever the cache)
        self._by_key: dict[int, Checkpoint] = {}  # published only
        self._lengths: Counter[int] = Counter()  # token counts of published checkpoints
        self._next_cid = 0
        self._clock = 0
        self.num_published = 0
        self.num_duplicates = 0
        self.num_evicted = 0  # leaves dropped
        self.num_thinned = 0  # ancestors bypassed

    # -- queries ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._all)

    def checkpoints(self) -> list[Checkpoint]:
        return list(self._all.values())

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def pending(self) -> list[Checkpoint]:
        return list(self._pending.values())

    def contains_key(self, key: int) -> bool:
        return key in self._by_key

    def lookup(self, digests: PrefixDigests, max_tokens: int) -> Checkpoint | None:
        """The published checkpoint of the longest prefix (≤ max_tokens) of `digests`; one of
        exactly max_tokens only if it can sample the next token (it has its hidden vector)."""
        for n in sorted((n for n in self._lengths if n <= max_tokens), reverse=True):
            hit = self._by_key.get(digests.key(n))
            if hit is not None and (n < max_tokens or hit.has_hidden):
                self.touch(hit)
                return hit
        return None

    def lookup_pending(
        self, digests: PrefixDigests, max_tokens: int, min_tokens: int, step_id: int
    ) -> Checkpoint | None:
        """The pending checkpoint of the longest prefix of `digests` longer than `min_tokens`
        (at most max_tokens; exactly max_tokens only with its hidden vector) that step
        `step_id` may restore from: its snapshot is written by an earlier step, and no other
        checkpoint holds its key, so it is certain to be published rather than discarded as a
        duplicate (steps complete in order; a later capture of the same key is the duplicate).
        An agent's next turn, sent while the previous turn's terminal capture is in flight,
        is admitted in the next step instead of waiting for that capture to complete."""
        pending = self._pending.values()
        if not pending:
            return None
        keys = Counter(c.key for c in pending)
        best: Checkpoint | None = None
        for c in pending:
            n = c.num_tokens
            if not min_tokens < n <= max_tokens or c.step >= step_id:
                continue
            if n == max_tokens and not c.has_hidden:
                continue  # a full-prompt hit samples from the hidden vector
            if best is not None and n <= best.num_tokens:
                continue
            if keys[c.key] == 1 and c.key not in self._by_key and digests.key(n) == c.key:
                best = c
        if best is not None:
            self.touch(best)
        return best

    def chain_pages(self, ckpt: Checkpoint) -> list[int]:
        segments: list[list[int]] = []
        node: Checkpoint | None = ckpt
        while node is not None:
            segments.append(node.segment)
            node = node.parent
        return [p for seg in reversed(segments) for p in seg]

    def num_cached_pages(self) -> int:
        """Pages referenced by checkpoints only, kept current by the resource manager. A
        running request reads its prefix hit's pages through the checkpoint it pins, without
        references of its own: those pages count here while that pin keeps them from eviction."""
        return self._res.num_cached_pages

    def touch(self, ckpt: Checkpoint) -> None:
        self._clock += 1
        ckpt.last_access = self._clock

    # -- lifecycle --------------------------------------------------------------------------

    def begin(
        self,
        key: int,
        num_tokens: int,
        parent: Checkpoint | None,
        segment: list[int],
        tail_page: int,
        snapshot: int,
        fence: int,
        has_hidden: bool = True,
    ) -> Checkpoint:
        """A pending checkpoint. It takes a new reference on each segment page and the caller's
        reference on `tail_page`."""
        first = parent.num_tokens // self.page_size if parent else 0
        if first + len(segment) != num_tokens // self.page_size:
            raise ValueError("segment does not end at the checkpoint's last complete page")
        if (tail_page != NO_PAGE) != (num_tokens % self.page_size != 0):
            raise ValueError("a tail page is needed exactly when the endpoint is inside a page")
        self._res.hold(segment, () if tail_page == NO_PAGE else (tail_page,))
        ckpt = Checkpoint(
            self._next_cid, key, num_tokens, parent, list(segment), tail_page, snapshot, fence,
            has_hidden=has_hidden, step=fence,
        )  # fmt: skip
        self._next_cid += 1
        self._all[ckpt.cid] = ckpt
        self._pending[ckpt.cid] = ckpt
        if parent is not None:
            parent.children.append(ckpt)
        self.touch(ckpt)
        return ckpt

    def publish(self, ckpt: Checkpoint) -> bool:
        """Make a pending checkpoint visible; a duplicate key discards it instead (False)."""
        if ckpt.published:
            raise ValueError(f"{ckpt} is already published")
        if ckpt.key in self._by_key:
            self.num_duplicates += 1
            self._retire(ckpt)
            return False
        ckpt.published = True
        del self._pending[ckpt.cid]
        self._by_key[ckpt.key] = ckpt
        self._lengths[ckpt.num_tokens] += 1
        self.num_published += 1
        self.touch(ckpt)
        return True

    def pin(self, ckpt: Checkpoint) -> None:
        ckpt.num_pins += 1

    def unpin(self, ckpt: Checkpoint) -> None:
        if ckpt.num_pins < 1:
            raise ValueError(f"{ckpt} is not pinned")
        ckpt.num_pins -= 1

    # -- eviction ---------------------------------------------------------------------------

    def _is_removable_ancestor(self, c: Checkpoint) -> bool:
        return c.published and not c.num_pins and len(c.children) == 1 and c.children[0].published

    def _is_eligible_leaf(self, c: Checkpoint) -> bool:
        return c.published and not c.num_pins and not c.children

    def evict_for_snapshot(self) -> bool:
        """Retire one checkpoint to recover a snapshot row: thin a chain (the removable
        ancestor whose surviving neighbours delimit the shortest interval, interior before
        roots, ties by least recent use), else the least recently used eligible leaf."""
        thin = [c for c in self._all.values() if self._is_removable_ancestor(c)]
        if thin:

            def interval(c: Checkpoint) -> tuple[bool, int, int]:
                below = c.parent.num_tokens if c.parent else 0
                return (c.parent is None, c.children[0].num_tokens - below, c.last_access)

            self._retire(min(thin, key=interval))
            return True
        leaves = [c for c in self._all.values() if self._is_eligible_leaf(c)]
        if leaves:
            self._retire(min(leaves, key=lambda c: c.last_access))
            return True
        return False

    def evict_for_pages(self) -> bool:
        """Retire the least recently used eligible leaf or removable ancestor whose retirement
        gives back at least one page. False when there is none."""

        def frees_pages(c: Checkpoint) -> bool:
            if c.tail_page != NO_PAGE:
                return True
            return not c.children and any(self._res.refcount(p) == 1 for p in c.segment)

        cands = [
            c
            for c in self._all.values()
            if (self._is_eligible_leaf(c) or self._is_removable_ancestor(c)) and frees_pages(c)
        ]
        if not cands:
            return False
        self._retire(min(cands, key=lambda c: c.last_access))
        return True

    def evict_all(self) -> int:
        """Retire every checkpoint no request pins directly or through a descendant."""
        n = 0
        while True:
            cands = [
                c
                for c in self._all.values()
                if self._is_eligible_leaf(c) or self._is_removable_ancestor(c)
            ]
            if not cands:
                return n
            for c in cands:
                if c.cid in self._all and (
                    self._is_eligible_leaf(c) or self._is_removable_ancestor(c)
                ):
                    self._retire(c)
                    n += 1

    def discard(self, ckpt: Checkpoint) -> None:
        """Drop a pending checkpoint whose copy will not be published."""
        if ckpt.published:
            raise ValueError(f"{ckpt} is published")
        self._retire(ckpt)

    def _retire(self, c: Checkpoint) -> None:
        if c.published:
            del self._by_key[c.key]
            self._lengths[c.num_tokens] -= 1
            if not self._lengths[c.num_tokens]:
                del self._lengths[c.num_tokens]
        if len(c.children) > 1:
            raise AssertionError(f"{c} has {len(c.children)} children")
        if c.children:
            self._bypass(c)
        else:
            self._drop_leaf(c)
        if c.tail_page != NO_PAGE:
            self._res.unhold(c.tail_page, c.fence)
        self._res.free_snapshot(c.snapshot, c.fence)
        del self._all[c.cid]
        self._pending.pop(c.cid, None)

    def _bypass(self, c: Checkpoint) -> None:
        (child,) = c.children
        child.segment = c.segment + child.segment
        child.fence = max(child.fence, c.fence)
        child.parent = c.parent
        if c.parent is not None:
            siblings = c.parent.children
            siblings[siblings.index(c)] = child
        self.num_thinned += c.published

    def _drop_leaf(self, c: Checkpoint) -> None:
        for page_id in c.segment:
            self._res.unhold(page_id, c.fence)
        if c.parent is not None:
            c.parent.children.remove(c)
        self.num_evicted += c.published

    # -- integrity --------------------------------------------------------------------------

    def _page_refs(self) -> Counter[int]:
        refs: Counter[int] = Counter()
        for c in self._all.values():
            refs.update(c.segment)
            if c.tail_page != NO_PAGE:
                refs[c.tail_page] += 1
        return refs

    def check_integrity(self) -> tuple[Counter[int], list[int]]:
        """Raise AssertionError unless every link, key and count is consistent; return the page
        references and snapshots the checkpoints hold (for the resource check)."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        size = self.page_size
        published = [c for c in self._all.values() if c.published]
        require(
            self._pending == {c.cid: c for c in self._all.values() if not c.published},
            "pending index differs from the unpublished checkpoints",
        )
        require(
            {c.key: c for c in published} == self._by_key and len(published) == len(self._by_key),
            "key index differs from the published checkpoints",
        )
        require(
            Counter(c.num_tokens for c in published) == self._lengths,
            "length index differs from the published checkpoints",
        )
        for c in self._all.values():
            require(c.num_pins >= 0, f"{c}: negative pins")
            require(len({id(x) for x in c.children}) == len(c.children), f"{c}: child twice")
            for child in c.children:
                require(child.parent is c and child.cid in self._all, f"{c}: broken child link")
                require(child.num_tokens > c.num_tokens, f"{c}: child not longer")
                require(c.published or not child.published, f"{c}: published below pending")
            p = c.parent
            require(p is None or (p.cid in self._all and c in p.children), f"{c}: parent link")
            first = p.num_tokens // size if p else 0
            require(first + len(c.segment) == c.num_tokens // size, f"{c}: segment length")
            require((c.tail_page != NO_PAGE) == (c.num_tokens % size != 0), f"{c}: tail page")
            require(c.tail_page not in c.segment, f"{c}: tail page inside the segment")
            depth, node = 0, c.parent
            while node is not None:
                depth += 1
                require(depth <= len(self._all), f"{c}: cycle in the parent chain")
                node = node.parent
            chain = self.chain_pages(c)
            require(len(chain) == len(set(chain)), f"{c}: a page twice in its chain")
        snapshots = [c.snapshot for c in self._all.values()]
        require(len(snapshots) == len(set(snapshots)), "two checkpoints share a snapshot")
        return self._page_refs(), snapshots
