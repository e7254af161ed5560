"""Id allocators for the two device resources the scheduler hands out: KV pages and state rows.

Both are plain free lists of ints. They know nothing about requests; the scheduler records which
request owns which ids. A freed id is reused first (LIFO), which keeps the hot set small.
"""

from __future__ import annotations

from collections.abc import Iterable

from flared.engine.plan import NULL_ROW


class _IdPool:
    """A free list over a fixed range of ids. Invariant: free ∪ in_use == ids, free ∩ in_use == ∅."""

    def __init__(self, ids: range, what: str) -> None:
        self._ids = ids
        self._what = what
        # Reversed so that pop() hands out the lowest id first.
        self._free: list[int] = list(reversed(ids))
        self._in_use: set[int] = set()

    @property
    def num_total(self) -> int:
        return len(self._ids)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    def _take(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self._what}s")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        free = self._free
        taken = free[: -n - 1 : -1]  # the last n, in pop() order
        del free[-n:]
        self._in_use.update(taken)
        return taken

    def _give(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        given = set(ids)
        if len(given) != len(ids):
            raise ValueError(f"{self._what}s freed twice in one call: {ids}")
        if not given <= self._in_use:
            i = next(i for i in ids if i not in self._in_use)
            raise ValueError(f"{self._what} {i} is not allocated")
        self._in_use -= given
        self._free.extend(ids)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"duplicate {self._what}s on the free list")
        if free & self._in_use:
            raise AssertionError(
                f"{self._what}s both free and in use: {sorted(free & self._in_use)}"
            )
        if len(free) + len(self._in_use) != len(self._ids):
            raise AssertionError(
                f"{len(free)} free + {len(self._in_use)} in use != {len(self._ids)} {self._what}s"
            )
        if not (free | self._in_use) <= set(self._ids):
            raise AssertionError(f"{self._what} ids outside {self._ids}")


class PagePool(_IdPool):
    """Allocates KV page ids 0 .. num_pages-1 (the trash page num_pages is never handed out)."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be at least 1, got {num_pages}")
        super().__init__(range(num_pages), "page")

    def alloc(self, n: int) -> list[int] | None:
        """`n` page ids, or None (allocating nothing) when fewer than `n` are free."""
        return self._take(n)

    def free(self, page_ids: Iterable[int]) -> None:
        self._give(page_ids)


class RowPool(_IdPool):
    """Allocates request-state rows 1 .. max_num_rows; NULL_ROW (0) is never allocated."""

    def __init__(self, max_num_rows: int) -> None:
        if max_num_rows < 1:
            raise ValueError(f"max_num_rows must be at least 1, got {max_num_rows}")
        super().__init__(range(NULL_ROW + 1, NULL_ROW + 1 + max_num_rows), "row")

    def alloc(self) -> int | None:
        """One row id, or None when every row is taken."""
        taken = self._take(1)
        return None if taken is None else taken[0]

    def free(self, row: int) -> None:
        self._give((row,))

    def check_integrity(self) -> None:
        super().check_integrity()
        if NULL_ROW in self._free or NULL_ROW in self._in_use:
            raise AssertionError("NULL_ROW entered the row pool")


class SnapshotPool(_IdPool):
    """Allocates snapshot ids 0 .. num_snapshot_rows-1 (may be empty: the cache is then off)."""

    def __init__(self, num_snapshot_rows: int) -> None:
        if num_snapshot_rows < 0:
            raise ValueError(f"num_snapshot_rows must be non-negative, got {num_snapshot_rows}")
        super().__init__(range(num_snapshot_rows), "snapshot")

    def alloc(self) -> int | None:
        taken = self._take(1)
        return None if taken is None else taken[0]

    def free(self, snapshot: int) -> None:
        self._give((snapshot,))
