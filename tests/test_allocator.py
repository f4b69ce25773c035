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


def test_a_freed_slot_is_reused_for_its_size_and_merged_back_when_a_larger_one_needs_it():
    a = ExtentAllocator(8 * 1024)
    offs = [a.alloc(1000) for _ in range(8)]
    a.free_slot(offs[3], 1000)
    assert a.alloc(1000) == offs[3]  # the quick list: the same slot, same size
    assert a.alloc(1) is None
    for o in offs[2:6]:
        a.free_slot(o, 1000)
    with pytest.raises(ValueError):
        a.free_slot(offs[4], 1000)  # a double free of a quick-listed slot is refused too
    assert a.alloc(4096) == offs[2]  # no extent fits: the quick-listed slots merge, 4 KiB at the first
    assert a.used == 8 * 1024 and a.alloc(1) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), max_size=200), st.sampled_from([0, 3, 512]))
def test_no_overlap_and_full_recovery(ops, quick_slots):
    a = ExtentAllocator(64 * 1024, quick_slots)
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
