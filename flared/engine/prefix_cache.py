"""The scheduler's side of the prefix cache: lookups at admission, captures, publication.

Every operation that touches the GPU is returned as a plan op (RestoreOp, SnapshotOp) for the
step being planned; a capture becomes a pending checkpoint and is published (or discarded as a
duplicate) only when `step_completed` reports that its step finished. Admissions planned in
later steps may restore from a pending checkpoint that is certain to be published: steps run in
order, so its snapshot is written before the restore reads it. With no snapshot rows the
cache is off: lookups miss and nothing is captured.

Pinning: a live request pins its `anchor`, the deepest checkpoint of its own chain (its prefix
hit, then each capture it makes), so that its next capture can link to it: the next segment is
`req.pages[anchor.num_tokens // P : S // P]`, and `req.pages[:anchor.num_tokens // P]` always
equals the anchor's chain pages.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from flared.engine.capture import select_captures, snapshot_budget
from flared.engine.checkpoints import Checkpoint, CheckpointStore
from flared.engine.config import SchedulerConfig
from flared.engine.digests import HASH_BLOCK_TOKENS, PrefixDigests, root_digest
from flared.engine.plan import NO_PAGE, PageCopy, RestoreOp, SnapshotOp
from flared.engine.request import Request
from flared.engine.resources import ResourceManager

# A capture attempt retires at most this many checkpoints to find its tail page.
_MAX_TAIL_EVICTIONS = 4
_STRIDE = 8  # blocks compared at once by _shared_blocks before it compares one by one
# Finished histories whose block digests a next request may start from (see _recent_prefix).
RECENT_CHAINS = 8


def _shared_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many whole 64-token blocks `a` and `b` begin with in common (tuple slices compare at
    C speed: strides of blocks first, then single blocks)."""
    n = HASH_BLOCK_TOKENS
    limit = min(len(a), len(b)) // n
    k = 0
    while k + _STRIDE <= limit and a[k * n : (k + _STRIDE) * n] == b[k * n : (k + _STRIDE) * n]:
        k += _STRIDE
    while k < limit and a[k * n : (k + 1) * n] == b[k * n : (k + 1) * n]:
        k += 1
    return k


@dataclass(frozen=True)
class Capture:
    """A pending checkpoint and the request that computed it, published with its step."""

    checkpoint: Checkpoint
    owner: Request


class PrefixCache:
    def __init__(self, config: SchedulerConfig, resources: ResourceManager) -> None:
        self.config = config
        self._res = resources
        self.store = CheckpointStore(resources)
        self.budget = snapshot_budget(config.num_snapshot_rows, config.max_num_rows)
        self._root = root_digest(config.model_id, config.token_layout)
        # (history, its digests) of the last requests to leave, newest last
        self._recent: deque[tuple[tuple[int, ...], PrefixDigests]] = deque(maxlen=RECENT_CHAINS)
        self.num_hits = 0
        self.num_full_hits = 0
        self.num_hit_tokens = 0
        self.num_captures_skipped = 0  # no snapshot row or tail page could be had
        self.num_page_pressure = 0  # times pages were short (admission, growth, capture)
        self.num_page_evictions = 0
        self.num_snapshot_pressure = 0  # times no snapshot row was free for a capture
        self.num_snapshot_evictions = 0
        self.num_preemption_checkpoints = 0

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def _digests(self, req: Request, num_tokens: int) -> PrefixDigests:
        if req.digests is None:
            req.digests = self._recent_prefix(req, num_tokens) or PrefixDigests(self._root, ())
        have = len(req.digests)
        if have < num_tokens:
            req.digests.extend(req.history_range(have, num_tokens))
        return req.digests

    def _recent_prefix(self, req: Request, num_tokens: int) -> PrefixDigests | None:
        """Digests of the whole 64-token blocks that `req`'s first tokens share with a recently
        finished history (an agent's next turn extends the last one; a branch shares its
        trunk): only the tokens after them are hashed then."""
        if not self._recent:
            return None
        history = req.history(num_tokens)
        best: PrefixDigests | None = None
        best_blocks = 0
        n = HASH_BLOCK_TOKENS
        for tokens, digests in reversed(self._recent):
            nxt = slice(best_blocks * n, (best_blocks + 1) * n)
            if len(tokens) < nxt.stop or history[nxt] != tokens[nxt]:
                continue  # cannot share more blocks than the best so far
            blocks = _shared_blocks(history, tokens)
            if blocks > best_blocks:
                best, best_blocks = digests, blocks
                if blocks == num_tokens // HASH_BLOCK_TOKENS:
                    break
        return None if best is None else best.fork(best_blocks * HASH_BLOCK_TOKENS)

    def _remember(self, req: Request) -> None:
        """Keep the digests of a leaving request's history for `_recent_prefix`."""
        if req.digests is not None and len(req.digests):
            n = len(req.digests)
            self._recent.append((req.history(n), req.digests.fork(n)))

    # -- admission --------------------------------------------------------------------------

    def lookup(self, req: Request, step_id: int) -> Checkpoint | None:
        """The longest cached prefix of the life's prompt for an admission in step `step_id`,
        pinned (`unpin` if not admitted): a published checkpoint, or a longer pending one that
        an earlier step writes (`CheckpointStore.lookup_pending`)."""
        if not self.enabled:
            return None
        n = len(req.life_prompt)
        digests = self._digests(req, n)
        hit = self.store.lookup(digests, n)
        have = hit.num_tokens if hit is not None else 0
        hit = self.store.lookup_pending(digests, n, have, step_id) or hit
        if hit is not None:
            self.store.pin(hit)
        return hit

    def unpin(self, ckpt: Checkpoint) -> None:
        self.store.unpin(ckpt)

    def coming(self, req: Request, hit: Checkpoint | None, leaving: list[Request]) -> bool:
        """Whether a longer prefix of `req`'s prompt than `hit` is about to be cached: a pending
        checkpoint (published when its step completes), or the terminal capture still owed by
        a finished request (`leaving`). An agent's next turn, submitted the moment the previous
        one finished, extends that one's output: admitting it a step later from its terminal
        checkpoint beats prefilling everything after the prompt checkpoint."""
        if not self.enabled:
            return False
        n = len(req.life_prompt)
        have = hit.num_tokens if hit is not None else 0
        counts = [(c.num_tokens, c.key, c.has_hidden) for c in self.store.pending()]
        for other in leaving:
            m = other.num_consumed
            if other.capture_terminal and have < m <= n:
                counts.append((m, self._digests(other, m).key(m), True))
        for m, key, has_hidden in counts:
            if have < m <= n and (m < n or has_hidden) and self._digests(req, m).key(m) == key:
                return True
        return False

    def shared_pages(self, hit: Checkpoint | None) -> list[int]:
        return [] if hit is None else self.store.chain_pages(hit)

    def reclaim_pages(self, num_free: int) -> bool:
        """Evict under page pressure until `num_free` pages are free; False if it fell short."""
        if self._res.pages.num_free >= num_free:
            return True
        self.num_page_pressure += 1
        while self._res.pages.num_free < num_free:
            if not self.store.evict_for_pages():
                return False
            self.num_page_evictions += 1
        return True

    def evict_one_for_pages(self) -> bool:
        if self.store.evict_for_pages():
            self.num_page_evictions += 1
            return True
        return False

    def admitted(self, req: Request, hit: Checkpoint | None, step_id: int) -> RestoreOp | None:
        """`req` was admitted with `hit`'s chain pages in front: anchor it, select its captures
        and return the restore (None on a miss)."""
        reused = hit.num_tokens if hit else 0
        req.num_admissions += 1
        if req.num_admissions == 1:
            req.cached_tokens = min(reused, len(req.prompt_token_ids))
        req.captures = select_captures(
            self.budget, reused, len(req.life_prompt), req.life_params.max_tokens,
            req.endpoints, self.config.min_capture_gap,
        )  # fmt: skip
        if hit is None:
            return None
        self.num_hits += 1
        self.num_full_hits += reused == len(req.life_prompt)
        self.num_hit_tokens += reused
        req.anchor = hit
        req.num_prefill_scheduled = reused
        hit.fence = max(hit.fence, step_id)
        size = self.config.page_size
        tail = None
        if reused % size:
            tail = PageCopy(hit.tail_page, req.pages[reused // size])
        return RestoreOp(req.request_id, req.row, hit.snapshot, reused, tail)

    def release(self, req: Request) -> None:
        """The request's life ends: drop its pin."""
        if req.anchor is not None:
            self.store.unpin(req.anchor)
            req.anchor = None

    def drop_anchors(self, requests: list[Request]) -> bool:
        """Under page pressure: unpin the anchors of running requests so that eviction may
        retire them. A request without an anchor links its next capture to no parent (its
        segment then starts at page 0 and shares the pages it maps). True if any was dropped."""
        dropped = False
        for req in requests:
            if req.anchor is not None:
                self._res.own_borrowed(req)  # the chain may be retired once unpinned
                self.release(req)
                dropped = True
        return dropped

    # -- captures ---------------------------------------------------------------------------

    def _obtain_snapshot(self) -> int | None:
        snapshot = self._res.alloc_snapshot()
        if snapshot is None:
            self.num_snapshot_pressure += 1
            if self.store.evict_for_snapshot():
                self.num_snapshot_evictions += 1
                snapshot = self._res.alloc_snapshot()  # None if the retired row is fenced
        return snapshot

    def _wanted(self, req: Request, num_tokens: int) -> int | None:
        """The key of a new checkpoint at `num_tokens`, or None when there is nothing new."""
        if not self.enabled or num_tokens < 1:
            return None
        if req.anchor is not None and num_tokens <= req.anchor.num_tokens:
            return None
        key = self._digests(req, num_tokens).key(num_tokens)
        return None if self.store.contains_key(key) else key

    def _begin(
        self,
        req: Request,
        key: int,
        num_tokens: int,
        tail: int,
        snapshot: int,
        step_id: int,
        has_hidden: bool = True,
    ) -> Checkpoint:
        size = self.config.page_size
        parent = req.anchor
        first = parent.num_tokens // size if parent else 0
        segment = req.pages[first : num_tokens // size]
        return self.store.begin(
            key, num_tokens, parent, segment, tail, snapshot, step_id, has_hidden
        )

    def capture_live(
        self, req: Request, num_tokens: int, step_id: int, inside_chunk: bool = False
    ) -> Capture | None:
        """Snapshot a request that continues after this step, at its exact consumed count
        `num_tokens` once the step's prefill is done; its tail page is copied. `inside_chunk`:
        the step's chunk runs past `num_tokens` (models without recurrent state only), so the
        checkpoint is its pages and count, without a hidden vector to sample from."""
        key = self._wanted(req, num_tokens)
        if key is None:
            return None
        snapshot = self._obtain_snapshot()
        if snapshot is None:
            self.num_captures_skipped += 1
            return None
        size = self.config.page_size
        tail = NO_PAGE
        if num_tokens % size:
            for _ in range(_MAX_TAIL_EVICTIONS):
                if self._res.pages.num_free or not self.evict_one_for_pages():
                    break
            got = self._res.alloc_page()
            if got is None:
                self.num_page_pressure += 1
                self._res.free_snapshot(snapshot, -1)  # never used
                self.num_captures_skipped += 1
                return None
            tail = got
        ckpt = self._begin(req, key, num_tokens, tail, snapshot, step_id, not inside_chunk)
        self.release(req)
        req.anchor = ckpt
        self.store.pin(ckpt)
        return Capture(ckpt, req)

    def capture_leaving(
        self, req: Request, step_id: int, min_free_pages: int = 0
    ) -> tuple[Capture | None, SnapshotOp | None]:
        """Snapshot the terminal consumed boundary of a request whose life ends in this step
        (finished, or preempted): its tail page passes to the snapshot instead of being copied.
        Skipped unless at least `min_free_pages` pages are free once the request's pages outside
        the checkpoint are released (backing for the checkpoint must not be the pages another
        request is waiting for). Releases the request's row and pages either way (the row
        fenced by this step)."""
        num_tokens = req.num_consumed
        key = self._wanted(req, num_tokens)
        self._remember(req)
        if key is not None and min_free_pages > 0:
            kept = -(-num_tokens // self.config.page_size)
            freed = sum(self._res.refcount(p) == 1 for p in req.pages[kept:])
            if self._res.pages.num_free + freed < min_free_pages:
                key = None
        snapshot = None if key is None else self._obtain_snapshot()
        if key is None or snapshot is None:
            self.num_captures_skipped += key is not None
            self.release(req)
            self._res.release(req)
            return None, None
        size = self.config.page_size
        tail = req.pages[num_tokens // size] if num_tokens % size else NO_PAGE
        ckpt = self._begin(req, key, num_tokens, tail, snapshot, step_id)
        op = SnapshotOp(req.request_id, req.row, snapshot, num_tokens, None)
        self.release(req)
        keep = () if tail == NO_PAGE else (tail,)
        self._res.release(req, row_fence=step_id, keep=keep)
        return Capture(ckpt, req), op

    def snapshot_op(self, capture: Capture) -> SnapshotOp:
        """The op of a live capture (the tail is copied from the request's page)."""
        ckpt, req = capture.checkpoint, capture.owner
        size = self.config.page_size
        tail = None
        if ckpt.tail_page != NO_PAGE:
            tail = PageCopy(req.pages[ckpt.num_tokens // size], ckpt.tail_page)
        return SnapshotOp(req.request_id, req.row, ckpt.snapshot, ckpt.num_tokens, tail)

    def step_completed(self, captures: tuple[Capture, ...]) -> None:
        """The step holding `captures` completed: publish them (duplicates are discarded; a
        request anchored on its discarded capture falls back to that capture's parent)."""
        for cap in captures:
            ckpt, owner = cap.checkpoint, cap.owner
            if owner.awaiting is ckpt:
                owner.awaiting = None
            if not self.store.contains_key(ckpt.key):
                self.store.publish(ckpt)
                continue
            if owner.anchor is ckpt:
                self.store.unpin(ckpt)
                owner.anchor = ckpt.parent
                if ckpt.parent is not None:
                    self.store.pin(ckpt.parent)
            if ckpt.num_pins:  # lookup_pending never hands out a checkpoint that can be a duplicate
                raise AssertionError(f"{ckpt}: a duplicate another request restored from")
            self.store.discard(ckpt)
            self.store.num_duplicates += 1

    def check_anchors(self, holders: list[Request], waiting: list[Request]) -> None:
        """Raise AssertionError unless pins equal the live requests anchored on each checkpoint,
        every anchored request maps its anchor's chain pages in front of its own, and waiting
        requests hold no pin."""

        def require(ok: bool, what: str) -> None:
            if not ok:
                raise AssertionError(what)

        pins: Counter[int] = Counter()
        size = self.config.page_size
        for req in holders:
            if req.anchor is None:
                require(not req.num_borrowed, f"{req.request_id}: borrows without a pin")
                continue
            pins[req.anchor.cid] += 1
            chain = self.store.chain_pages(req.anchor)
            require(req.pages[: req.anchor.num_tokens // size] == chain, f"{req.request_id}: chain")
            require(req.num_borrowed <= len(chain), f"{req.request_id}: borrows past its chain")
            require(req.num_prefill_scheduled >= req.anchor.num_tokens, f"{req.request_id}: anchor")
        for c in self.store.checkpoints():
            require(c.num_pins == pins[c.cid], f"{c}: {c.num_pins} pins, {pins[c.cid]} anchored")
        for req in waiting:
            require(req.anchor is None, f"{req.request_id}: waiting with an anchor")
            require(
                req.awaiting is None or not req.awaiting.published, f"{req.request_id}: awaiting"
            )

    def stats(self) -> dict[str, int]:
        store = self.store
        return {
            "pages_cached": store.num_cached_pages(),
            "snapshots_total": self._res.snapshots.num_total,
            "snapshots_used": self._res.snapshots.num_in_use,
            "checkpoints": len(store),
            "prefix_hits_total": self.num_hits,
            "prefix_full_hits_total": self.num_full_hits,
            "prefix_hit_tokens_total": self.num_hit_tokens,
            "checkpoints_published_total": store.num_published,
            "checkpoints_duplicate_total": store.num_duplicates,
            "checkpoints_evicted_total": store.num_evicted,
            "checkpoints_thinned_total": store.num_thinned,
            "checkpoint_captures_skipped_total": self.num_captures_skipped,
            "page_pressure_total": self.num_page_pressure,
            "page_pressure_evictions_total": self.num_page_evictions,
            "snapshot_pressure_total": self.num_snapshot_pressure,
            "snapshot_pressure_evictions_total": self.num_snapshot_evictions,
            "preemption_checkpoints_total": self.num_preemption_checkpoints,
        }
