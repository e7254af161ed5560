import pytest
from hypothesis import given
from hypothesis import strategies as st

from flared.engine.plan import NULL_ROW
from flared.engine.pools import PagePool, RowPool


def test_page_pool_allocates_all_ids_once() -> None:
    pool = PagePool(5)
    got = pool.alloc(3)
    assert got is not None and len(set(got)) == 3
    assert pool.num_free == 2
    assert pool.alloc(3) is None and pool.num_free == 2  # short: allocates nothing
    rest = pool.alloc(2)
    assert rest is not None and sorted(got + rest) == [0, 1, 2, 3, 4]
    pool.free(got)
    assert pool.num_free == 3
    pool.check_integrity()


def test_page_pool_rejects_bad_frees() -> None:
    pool = PagePool(3)
    got = pool.alloc(2)
    assert got is not None
    with pytest.raises(ValueError):
        pool.free([got[0], got[0]])
    pool.free([got[0]])
    with pytest.raises(ValueError):
        pool.free([got[0]])
    with pytest.raises(ValueError):
        pool.free([3])
    pool.check_integrity()


def test_row_pool_never_hands_out_null_row() -> None:
    pool = RowPool(3)
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(r for r in rows if r is not None) == [1, 2, 3]
    assert NULL_ROW not in rows
    assert pool.alloc() is None
    with pytest.raises(ValueError):
        pool.free(NULL_ROW)
    pool.check_integrity()


@pytest.mark.parametrize("n", [0, -1])
def test_pools_need_a_positive_size(n: int) -> None:
    with pytest.raises(ValueError):
        PagePool(n)
    with pytest.raises(ValueError):
        RowPool(n)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_page_pool_random_alloc_free_keeps_integrity(ops: list[tuple[bool, int]]) -> None:
    pool = PagePool(10)
    held: list[list[int]] = []
    for is_alloc, n in ops:
        if is_alloc:
            free_before = pool.num_free
            got = pool.alloc(n)
            assert (got is None) == (n > free_before)
            if got is not None:
                held.append(got)
        elif held:
            pool.free(held.pop(n % len(held)))
        pool.check_integrity()
        assert pool.num_free + sum(map(len, held)) == 10


@given(
    size=st.integers(1, 8),
    pages=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    data=st.data(),
)
def test_kv_slots_equal_the_per_position_formula(size: int, pages: list[int], data) -> None:
    from flared.engine.resources import kv_slots

    n = len(pages) * size
    start = data.draw(st.integers(0, n - 1))
    end = data.draw(st.integers(start, n))
    expected = tuple(pages[p // size] * size + p % size for p in range(start, end))
    assert kv_slots(pages, size, start, end) == expected


def test_pools_hand_out_lowest_ids_first_and_reuse_the_last_freed() -> None:
    pool = PagePool(6)
    assert pool.alloc(3) == [0, 1, 2]
    assert pool.alloc(0) == []
    pool.free([2, 0])
    assert pool.alloc(2) == [0, 2]  # LIFO: the last freed comes back first
    assert pool.alloc(3) == [3, 4, 5]
    pool.check_integrity()


def test_page_table_writes_iterate_as_writes_and_give_their_columns() -> None:
    from flared.engine.plan import PageTableWrite, PageTableWrites, write_columns

    cols = ((1, 1, 2), (0, 1, 0), (7, 8, -1))
    writes = PageTableWrites(*cols)
    assert len(writes) == 3 and bool(writes)
    assert list(writes) == [
        PageTableWrite(1, 0, 7),
        PageTableWrite(1, 1, 8),
        PageTableWrite(2, 0, -1),
    ]
    assert write_columns(writes) == cols
    assert write_columns(tuple(writes)) == cols  # the tuple form gives the same columns
    assert write_columns(()) == ((), (), ()) and not PageTableWrites((), (), ())
    with pytest.raises(ValueError):
        PageTableWrites((1,), (0, 1), (7,))
