import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.tier.allocator import ALIGN, ExtentAllocator, aligned


def test_reuse_after_free_and_coalescing():
    a = ExtentAllocator(4 * 1024)
    offs = [a.alloc(1000) for _ in range(4)]
    assert offs == [0, 1024, 2048, 3072]
    assert a.alloc(1) is None
    a.free_slot(offs[1], 1000)
    a.free_slot(offs[2], 1000)
    assert a.largest_free() == 2048  # neighbours merged
    assert a.alloc(2000) == 1024
    assert a.used == 4096


def test_exact_accounting():
    a = ExtentAllocator(1 << 20)
    o = a.alloc(100)
    assert a.used == aligned(100) == 128
    a.free_slot(o, 100)
    assert a.used == 0 and a.free == a.capacity


def test_double_free_is_refused():
    a = ExtentAllocator(4096)
    o = a.alloc(64)
    a.free_slot(o, 64)
    with pytest.raises(ValueError):
        a.free_slot(o, 64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=200))
def test_no_overlap_and_full_recovery(ops):
    a = ExtentAllocator(64 * 1024)
    live: dict[int, int] = {}
    for is_alloc, size in ops:
        if is_alloc or not live:
            off = a.alloc(size)
            if off is not None:
                assert off % ALIGN == 0
                for o, s in live.items():
                    assert off + aligned(size) <= o or o + aligned(s) <= off, "overlap"
                live[off] = size
        else:
            off = next(iter(live))
            a.free_slot(off, live.pop(off))
        assert a.used == sum(aligned(s) for s in live.values())
    for off, size in list(live.items()):
        a.free_slot(off, size)
    assert a.used == 0 and a.largest_free() == a.capacity
