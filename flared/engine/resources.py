"""The one facade over the page, row and snapshot pools and the runner's resident page tables.

Pages are reference counted: a live request holds one reference per page it owns, a checkpoint
one per page of its chain segment and one for its partial tail page. A request admitted on a
prefix hit *borrows* the hit's chain pages (the front of its page list, `num_borrowed`): it
pins the checkpoint (prefix_cache), pinned checkpoints are never retired and retirement never
drops a descendant's chain pages (checkpoints), so those pages stay referenced for as long as
the request maps them, and admitting or releasing an agent's long conversation touches only its
own few new pages instead of every page of its history. A request whose pin is dropped under
page pressure first takes references of its own (`own_borrowed`). Logical
references are tracked separately from outstanding GPU use: an id whose last reference ends is
*fenced* until the step that last used it has completed (`step_completed`), and only then goes
back to its free list. Rows and snapshot ids follow the same rule.

The runner keeps page tables on the device and only receives diffs (`PageTableWrite`s). This
module keeps what each owned row's table must hold (`_desired`) and what the device's holds once
every write handed out so far is applied (`_device`), and the next plan takes the difference.
A released row's table is left as it is: no execution reads a free row, so its entries are
stale until its next admission, whose writes then rewrite only the entries that change and
clear those past the new owner's pages. An agent's next turn, admitted into the row of the
turn it extends with the same pages, writes a handful of entries instead of clearing and
rewriting hundreds. Invariants (checked by `check_integrity`):

    device[row] == desired[row] == owner.pages   for every row a request owns (between plans)
    refs[page] == references held                pages in use == referenced ∪ fenced, disjointly
                                                 (a request's borrowed pages hold none)
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence
from itertools import compress, repeat
from operator import add, eq, not_, sub

from flared.engine.plan import NO_PAGE, NULL_ROW, PageTableWrites
from flared.engine.pools import PagePool, RowPool, SnapshotPool
from flared.engine.request import Request


def _first_difference(a: list[int], b: list[int], lo: int) -> int:
    """The first index >= lo where `a` and `b` differ (one ending counts as a difference), or
    max(len(a), len(b)); found by bisecting with slice comparisons (C speed)."""
    hi = max(len(a), len(b))
    if a[lo:] == b[lo:]:
        return hi
    while hi - lo > 8:  # invariant: a[:lo] == b[:lo] (from the caller on) and a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    for k in range(lo, hi):
        if k >= len(a) or k >= len(b) or a[k] != b[k]:
            return k
    return hi


def kv_slots(pages: list[int], page_size: int, start: int, end: int) -> tuple[int, ...]:
    """KV slots of positions start .. end-1 of a row mapping `pages` (page-sized runs of
    consecutive slots)."""
    out: list[int] = []
    pos = start
    while pos < end:
        base = pages[pos // page_size] * page_size + pos % page_size
        stop = min(end, (pos // page_size + 1) * page_size)
        out.extend(range(base, base + stop - pos))
        pos = stop
    return tuple(out)


class ResourceManager:
    def __init__(
        self, num_pages: int, page_size: int, max_num_rows: int, num_snapshot_rows: int = 0
    ) -> None:
        self.page_size = page_size
        self.pages = PagePool(num_pages)
        self.rows = RowPool(max_num_rows)
        self.snapshots = SnapshotPool(num_snapshot_rows)
        self._refs: dict[int, int] = {}  # allocated, referenced page -> reference count
        # page -> the part of its references that checkpoints hold (see hold / unhold), and the
        # number of pages all of whose references checkpoints hold: the reclaimable cache,
        # kept current here because counting it over the cache would cost O(cached pages)
        self._held: dict[int, int] = {}
        self.num_cached_pages = 0
        self._fenced_pages: dict[int, int] = {}  # unreferenced page -> step that last used it
        self._fenced_rows: dict[int, int] = {}
        self._fenced_snapshots: dict[int, int] = {}
        self.last_completed_step = -1
        # Per row, the entries its device page table holds once every queued write is applied
        # (entries past the list's end are NO_PAGE), and per row the range [lo, hi) of entries
        # written since the last plan took them. Coalesced: only an entry's last value
        # matters, and a row's writes leave as one run, so releasing or admitting a long
        # request costs list operations, not Python work per page.
        self._desired: dict[int, list[int]] = {}
        self._device: dict[int, list[int]] = {}
        self._dirty: dict[int, int] = {}  # row -> first entry written since the last plan
        self._released: list[int] = []  # rows released since the last plan

    def pages_for_positions(self, num_positions: int) -> int:
        """Pages that hold positions 0 .. num_positions-1."""
        return -(-num_positions // self.page_size)

    # -- pages ------------------------------------------------------------------------------

    def can_admit(self, num_new_pages: int) -> bool:
        return self.rows.num_free >= 1 and self.pages.num_free >= num_new_pages

    def admit(self, req: Request, num_pages: int, shared: Sequence[int] = ()) -> None:
        """Give `req` a row and `num_pages` pages: the `shared` ones first, borrowed (the chain
        pages of the checkpoint the caller pins for the request; they take no reference, see
        the module docstring), then fresh private ones. Raises if `can_admit` was not checked."""
        row = self.rows.alloc()
        if row is None or self.pages.num_free < num_pages - len(shared):
            raise RuntimeError(f"admitting {req.request_id} without checking can_admit")
        req.row = row
        req.pages = list(shared)
        req.num_borrowed = len(shared)
        self._write_run(row, 0, req.pages)
        if not self.grow(req, num_pages):
            raise AssertionError("unreachable: pages were checked")

    def own_borrowed(self, req: Request) -> None:
        """`req` takes a reference of its own on each page it borrows (before its pin on the
        checkpoint that holds them is dropped)."""
        borrowed = req.pages[: req.num_borrowed]
        refs = self._refs
        if not refs.keys() >= set(borrowed):
            unknown = [p for p in borrowed if p not in refs]
            raise ValueError(f"borrowed pages {unknown[:4]} are not referenced")
        counts = list(map(refs.__getitem__, borrowed))
        held = map(self._held.get, borrowed, repeat(0))
        self.num_cached_pages -= sum(map(eq, counts, held))  # a live request owns them now
        refs.update(zip(borrowed, map(add, counts, repeat(1))))
        req.num_borrowed = 0

    def grow(self, req: Request, num_pages: int) -> bool:
        """Make `req` own at least `num_pages` pages. False (allocating nothing) when short."""
        missing = num_pages - len(req.pages)
        if missing <= 0:
            return True
        new = self.pages.alloc(missing)
        if new is None:
            return False
        self._refs.update(dict.fromkeys(new, 1))
        self._write_run(req.row, len(req.pages), new)
        req.pages.extend(new)
        return True

    def alloc_page(self) -> int | None:
        """One fresh page with one reference (a snapshot's tail page), or None when short."""
        got = self.pages.alloc(1)
        if got is None:
            return None
        self._refs[got[0]] = 1
        return got[0]

    def incref(self, page_id: int) -> None:
        if page_id not in self._refs:
            raise ValueError(f"page {page_id} is not referenced")
        before = self._is_cached(page_id)
        self._refs[page_id] += 1
        self.num_cached_pages += self._is_cached(page_id) - before

    def decref(self, page_id: int, fence: int) -> bool:
        """Drop one reference; True when it was the last one (the page then frees after
        `fence`, the newest step that used it, has completed)."""
        before = self._is_cached(page_id)
        count = self._refs[page_id] - 1
        if count:
            self._refs[page_id] = count
            self.num_cached_pages += self._is_cached(page_id) - before
            return False
        del self._refs[page_id]
        self.num_cached_pages -= before
        if fence > self.last_completed_step:
            self._fenced_pages[page_id] = fence
        else:
            self.pages.free((page_id,))
        return True

    def _is_cached(self, page_id: int) -> bool:
        held = self._held.get(page_id, 0)
        return held > 0 and self._refs.get(page_id, 0) == held

    def hold(self, page_ids: Iterable[int], transferred: Iterable[int] = ()) -> None:
        """A checkpoint takes a new reference on each of `page_ids` and takes over an existing
        reference on each of `transferred` (a tail page handed to it)."""
        new = list(page_ids)
        refs, held = self._refs, self._held
        if not refs.keys() >= set(new) or len(set(new)) != len(new):
            raise ValueError(f"pages {new[:4]}... are not referenced, or repeat")
        # a new reference on each leaves "cached" (all references are checkpoints') as it was
        refs.update(zip(new, map(add, map(refs.__getitem__, new), repeat(1))))
        held.update(zip(new, map(add, map(held.get, new, repeat(0)), repeat(1))))
        for page_id in transferred:
            self._hold_one(page_id, new_reference=False)

    def _hold_one(self, page_id: int, new_reference: bool) -> None:
        if page_id not in self._refs:
            raise ValueError(f"page {page_id} is not referenced")
        before = self._is_cached(page_id)
        if new_reference:
            self._refs[page_id] += 1
        self._held[page_id] = self._held.get(page_id, 0) + 1
        if self._held[page_id] > self._refs[page_id]:
            raise ValueError(f"checkpoints would hold more references of {page_id} than exist")
        self.num_cached_pages += self._is_cached(page_id) - before

    def unhold(self, page_id: int, fence: int) -> bool:
        """A checkpoint drops its reference (as decref; True when it was the last one)."""
        before = self._is_cached(page_id)
        held = self._held[page_id] - 1
        if held:
            self._held[page_id] = held
        else:
            del self._held[page_id]
        self.num_cached_pages += self._is_cached(page_id) - before
        return self.decref(page_id, fence)

    def refcount(self, page_id: int) -> int:
        return self._refs.get(page_id, 0)

    @property
    def num_fenced_pages(self) -> int:
        return len(self._fenced_pages)

    # -- rows and snapshots -----------------------------------------------------------------

    def alloc_snapshot(self) -> int | None:
        return self.snapshots.alloc()

    def free_snapshot(self, snapshot: int, fence: int) -> None:
        if fence > self.last_completed_step:
            self._fenced_snapshots[snapshot] = fence
        else:
            self.snapshots.free(snapshot)

    def release(self, req: Request, row_fence: int = -1, keep: Iterable[int] = ()) -> None:
        """Drop `req`'s row and page references; its page-table entries are cleared in the next
        plan. Only valid once no in-flight step uses its pages. `row_fence`: the newest step
        that uses the row (a snapshot of it in the step being planned). `keep`: pages whose
        reference passes to a checkpoint instead of being dropped."""
        if req.row == NULL_ROW:
            return
        # in bulk: a long request holds hundreds of pages, and this runs while the next
        # turn of its conversation waits to be admitted
        self._desired.pop(req.row, None)
        self._dirty.pop(req.row, None)  # its device entries stay, stale (module docstring)
        self._released.append(req.row)
        kept = set(keep)
        refs = self._refs
        owned = req.pages[req.num_borrowed :]  # borrowed pages hold no reference of req's
        pages = [p for p in owned if p not in kept] if kept else owned
        counts = list(map(sub, map(refs.__getitem__, pages), repeat(1)))
        refs.update(zip(pages, counts))
        freed = list(compress(pages, map(not_, counts)))
        deque(map(refs.__delitem__, freed), maxlen=0)
        # pages left with only checkpoint references are now cached (freed pages, 0 == 0,
        # are counted by eq and taken off again)
        held = map(self._held.get, pages, repeat(0))
        self.num_cached_pages += sum(map(eq, counts, held)) - len(freed)
        # no in-flight step uses them (see above): free now, as decref(page, -1) would
        self.pages.free(freed)
        if row_fence > self.last_completed_step:
            self._fenced_rows[req.row] = row_fence
        else:
            self.rows.free(req.row)
        req.row = NULL_ROW
        req.pages = []
        req.num_borrowed = 0

    def step_completed(self, step_id: int) -> None:
        """Every step up to `step_id` has completed: fenced ids whose fence passed are free."""
        self.last_completed_step = step_id
        for fenced, free in (
            (self._fenced_pages, lambda i: self.pages.free((i,))),
            (self._fenced_rows, self.rows.free),
            (self._fenced_snapshots, self.snapshots.free),
        ):
            for i in [i for i, fence in fenced.items() if fence <= step_id]:
                del fenced[i]
                free(i)

    @property
    def has_fenced(self) -> bool:
        return bool(self._fenced_pages or self._fenced_rows or self._fenced_snapshots)

    # -- resident page tables ---------------------------------------------------------------

    def _write_run(self, row: int, start: int, page_ids: Sequence[int]) -> None:
        """Queue page_table[row][start + k] = page_ids[k] (real pages). A run starts at or
        before the end of what the row maps (admission and growth append)."""
        desired = self._desired.setdefault(row, [])
        if start > len(desired):
            raise ValueError(f"page-table run of row {row} at {start} leaves a gap")
        desired[start : start + len(page_ids)] = page_ids
        self._dirty[row] = min(start, self._dirty.get(row, start))

    @property
    def has_pending_writes(self) -> bool:
        return bool(self._dirty)

    def take_released(self) -> tuple[int, ...]:
        """Rows released since the last call (their device entries are stale from now on).
        Carried by the next plan for observers of the device state; the runner ignores it."""
        out = tuple(self._released)
        self._released.clear()
        return out

    def take_writes(self) -> PageTableWrites:
        """The writes that bring each written row's device table to what its owner maps: from
        the first entry that differs, plus clears of stale entries past the owner's pages (at
        C speed: slices and list operations, no Python work per entry)."""
        if not self._dirty:
            return PageTableWrites((), (), ())
        rows: list[int] = []
        index: list[int] = []
        pages: list[int] = []
        for row, lo in sorted(self._dirty.items()):
            desired = self._desired.get(row, [])
            device = self._device.setdefault(row, [])
            k = _first_difference(desired, device, lo)
            end = max(len(desired), len(device))
            if k < end:
                rows += [row] * (end - k)
                index += range(k, end)
                pages += desired[k:]
                pages += [NO_PAGE] * (end - max(k, len(desired)))
            device[:] = desired
        self._dirty.clear()
        return PageTableWrites(tuple(rows), tuple(index), tuple(pages))

    # -- integrity --------------------------------------------------------------------------

    def check_integrity(
        self,
        owners: Iterable[Request],
        other_refs: Counter[int] | None = None,
        snapshots_held: Iterable[int] = (),
    ) -> None:
        """`owners`: every request that holds a row (running, or finished awaiting release);
        `other_refs`: page references held by checkpoints; `snapshots_held`: their snapshots."""
        self.pages.check_integrity()
        self.rows.check_integrity()
        self.snapshots.check_integrity()
        expected_refs: Counter[int] = Counter(other_refs or {})
        expected: dict[int, list[int]] = {}
        owned_rows: list[int] = []
        for req in owners:
            if req.row == NULL_ROW:
                raise AssertionError(f"{req.request_id} owns pages without a row")
            if len(set(req.pages)) != len(req.pages):
                raise AssertionError(f"{req.request_id} maps one page twice")
            owned_rows.append(req.row)
            expected_refs.update(req.pages[req.num_borrowed :])
            if req.pages:
                expected[req.row] = list(req.pages)
        if dict(expected_refs) != self._refs:
            raise AssertionError("page reference counts differ from the references held")
        if dict(other_refs or {}) != self._held:
            raise AssertionError("references held by checkpoints differ from their pages")
        cached = sum(1 for p, n in (other_refs or {}).items() if self._refs.get(p) == n)
        if cached != self.num_cached_pages:
            raise AssertionError(f"{self.num_cached_pages} cached pages counted, {cached} held")
        if set(self._refs) & set(self._fenced_pages):
            raise AssertionError("a referenced page is fenced")
        if set(self._refs) | set(self._fenced_pages) != self.pages.in_use():
            raise AssertionError("pages in use differ from referenced + fenced pages")
        if len(set(owned_rows)) != len(owned_rows):
            raise AssertionError("a row is owned by two requests")
        if set(owned_rows) & set(self._fenced_rows):
            raise AssertionError("an owned row is fenced")
        if set(owned_rows) | set(self._fenced_rows) != self.rows.in_use():
            raise AssertionError("rows in use differ from owned + fenced rows")
        held = list(snapshots_held)
        if len(set(held)) != len(held) or set(held) & set(self._fenced_snapshots):
            raise AssertionError("a snapshot is held twice or held while fenced")
        if set(held) | set(self._fenced_snapshots) != self.snapshots.in_use():
            raise AssertionError("snapshots in use differ from held + fenced snapshots")
        for fenced in (self._fenced_pages, self._fenced_rows, self._fenced_snapshots):
            if any(f <= self.last_completed_step for f in fenced.values()):
                raise AssertionError("a fence that has passed still holds an id")
        desired = {row: pages for row, pages in self._desired.items() if pages}
        if self._dirty or expected != desired:
            raise AssertionError("page tables to be written differ from owned pages")
        if any(self._device.get(row) != pages for row, pages in expected.items()):
            raise AssertionError("resident page-table mirror differs from owned pages")
