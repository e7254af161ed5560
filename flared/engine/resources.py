"""The one facade over the page pool, the row pool and the runner's resident page tables.

The runner keeps page tables on the device and only receives diffs (`PageTableWrite`s). This
module keeps a mirror of what those tables hold once every write handed out so far is applied,
and queues the writes until the next plan takes them. Invariant (checked by `check_integrity`):

    mirror[(row, i)] == owner.pages[i]   for every request owning `row`, i < len(owner.pages)
    no other (row, i) entry exists        (free rows are all NO_PAGE on the device)
"""

from __future__ import annotations

from collections.abc import Iterable

from flared.engine.plan import NO_PAGE, NULL_ROW, PageTableWrite
from flared.engine.pools import PagePool, RowPool
from flared.engine.request import Request


class ResourceManager:
    def __init__(self, num_pages: int, page_size: int, max_num_rows: int) -> None:
        self.page_size = page_size
        self.pages = PagePool(num_pages)
        self.rows = RowPool(max_num_rows)
        self._mirror: dict[tuple[int, int], int] = {}
        # Coalesced: only the last value written to an entry before a plan matters.
        self._pending: dict[tuple[int, int], int] = {}

    def pages_for_positions(self, num_positions: int) -> int:
        """Pages that hold positions 0 .. num_positions-1."""
        return -(-num_positions // self.page_size)

    def can_admit(self, num_pages: int) -> bool:
        return self.rows.num_free >= 1 and self.pages.num_free >= num_pages

    def admit(self, req: Request, num_pages: int) -> None:
        """Give `req` a row and `num_pages` pages; raises if `can_admit` was not checked."""
        row = self.rows.alloc()
        if row is None or self.pages.num_free < num_pages:
            raise RuntimeError(f"admitting {req.request_id} without checking can_admit")
        req.row = row
        req.pages = []
        if not self.grow(req, num_pages):
            raise AssertionError("unreachable: pages were checked")

    def grow(self, req: Request, num_pages: int) -> bool:
        """Make `req` own at least `num_pages` pages. False (allocating nothing) when short."""
        missing = num_pages - len(req.pages)
        if missing <= 0:
            return True
        new = self.pages.alloc(missing)
        if new is None:
            return False
        for page_id in new:
            self._write(req.row, len(req.pages), page_id)
            req.pages.append(page_id)
        return True

    def release(self, req: Request) -> None:
        """Return `req`'s row and pages; its page-table entries are cleared in the next plan.

        Only valid once no in-flight step references the row: its pages may be reused at once.
        """
        if req.row == NULL_ROW:
            return
        for index in range(len(req.pages)):
            self._write(req.row, index, NO_PAGE)
        self.pages.free(req.pages)
        self.rows.free(req.row)
        req.row = NULL_ROW
        req.pages = []

    def _write(self, row: int, index: int, page_id: int) -> None:
        self._pending[(row, index)] = page_id
        if page_id == NO_PAGE:
            self._mirror.pop((row, index), None)
        else:
            self._mirror[(row, index)] = page_id

    @property
    def has_pending_writes(self) -> bool:
        return bool(self._pending)

    def take_writes(self) -> tuple[PageTableWrite, ...]:
        writes = tuple(PageTableWrite(r, i, p) for (r, i), p in self._pending.items())
        self._pending.clear()
        return writes

    def check_integrity(self, owners: Iterable[Request]) -> None:
        """`owners`: every request that holds a row (running, or finished awaiting release)."""
        self.pages.check_integrity()
        self.rows.check_integrity()
        expected: dict[tuple[int, int], int] = {}
        owned_pages: list[int] = []
        owned_rows: list[int] = []
        for req in owners:
            if req.row == NULL_ROW:
                raise AssertionError(f"{req.request_id} owns pages without a row")
            owned_rows.append(req.row)
            owned_pages.extend(req.pages)
            expected.update(((req.row, i), p) for i, p in enumerate(req.pages))
        if len(set(owned_pages)) != len(owned_pages):
            raise AssertionError("a page is owned by two requests (or twice by one)")
        if len(set(owned_rows)) != len(owned_rows):
            raise AssertionError("a row is owned by two requests")
        if set(owned_pages) != self.pages.in_use():
            raise AssertionError("pages in use differ from pages owned by requests")
        if set(owned_rows) != self.rows.in_use():
            raise AssertionError("rows in use differ from rows owned by requests")
        if expected != self._mirror:
            raise AssertionError("resident page-table mirror differs from owned pages")
