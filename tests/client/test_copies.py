"""The local path's copies: split in two halves by bytes for the helper thread, byte-exact."""

import numpy as np

from gcache.client import localpath
from gcache.client.localpath import copy_all, copy_pairs, halves


def views(sizes, fill=None, seed=0):
    rng = np.random.default_rng(seed)
    return [memoryview(rng.integers(0, 256, s, dtype=np.uint8) if fill is None else np.full(s, fill, np.uint8))
            for s in sizes]


def test_halves_cut_at_the_byte_asked_for_splitting_a_straddling_copy():
    src = views([10, 30, 20])
    dst = views([10, 30, 20], fill=0)
    pairs = list(zip(dst, src))
    first, second = halves(pairs, 25)
    assert [len(d) for d, _s in first] == [10, 15] and [len(d) for d, _s in second] == [15, 20]
    assert sum(len(d) for d, _s in first) == 25
    first, second = halves(pairs, 40)  # a cut on a boundary splits nothing
    assert [len(d) for d, _s in first] == [10, 30] and [len(d) for d, _s in second] == [20]
    assert halves(pairs, 60) == (pairs, [])


def test_copy_all_over_two_threads_is_byte_exact(monkeypatch):
    monkeypatch.setattr(localpath, "PARALLEL_COPY_BYTES", 1)
    monkeypatch.setattr(localpath, "CPUS", 2)
    sizes = [1, 4096, 100_000, 3, 65536]
    src, dst = views(sizes, seed=1), views(sizes, fill=0)
    copy_all(list(zip(dst, src)))
    assert all(bytes(d) == bytes(s) for d, s in zip(dst, src))
    one_src, one_dst = views([1 << 20], seed=2), views([1 << 20], fill=0)  # one value, cut in two
    copy_all([(one_dst[0], one_src[0])])
    assert bytes(one_dst[0]) == bytes(one_src[0])


def test_copy_pairs_skip_empty_parts_and_fill_the_rest():
    """An empty part of a scatter destination takes nothing; the parts after it take the rest."""
    src = memoryview(bytes(range(150)))
    a, empty, b = bytearray(100), bytearray(0), bytearray(100)
    pairs = copy_pairs(src, [memoryview(a), memoryview(empty), memoryview(b)])
    assert [len(d) for d, _s in pairs] == [100, 50]
    copy_all(pairs)
    assert bytes(a) + bytes(b[:50]) == bytes(src) and bytes(b[50:]) == bytes(50)
