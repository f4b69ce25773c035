import numpy as np
import pytest

from gcache.errors import ConfigError
from gcache.meta.ring import HashRing

KEYS = [f"page-{i}".encode() for i in range(100_000)]


def counts(ring, keys=KEYS):
    owners = ring.owners("ns", keys)
    return {n: owners.count(n) for n in ring.node_ids}, owners


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_balance_max_over_mean_at_most_1_10(n):
    # default: 1024 vnodes per node (the floor is 128, whose ~9% spread can exceed 1.10)
    c, _ = counts(HashRing({f"node{i}": 1.0 for i in range(n)}))
    assert max(c.values()) / (len(KEYS) / n) <= 1.10


@pytest.mark.parametrize("n", [3, 5, 9])
def test_adding_a_node_moves_about_one_over_n_plus_one(n):
    before = HashRing({f"node{i}": 1.0 for i in range(n)})
    after = HashRing({f"node{i}": 1.0 for i in range(n + 1)})
    _, o1 = counts(before)
    _, o2 = counts(after)
    moved = [a != b for a, b in zip(o1, o2)]
    frac = sum(moved) / len(KEYS)
    assert abs(frac - 1 / (n + 1)) <= 0.25 / (n + 1)
    # every moved key moved to the new node: nothing shuffles between old nodes
    assert all(b == f"node{n}" for a, b, m in zip(o1, o2, moved) if m)


def test_deterministic_and_order_independent():
    a = HashRing({"x": 1.0, "y": 2.0, "z": 1.0})
    b = HashRing({"z": 1.0, "y": 2.0, "x": 1.0})
    assert a.owners("ns", KEYS[:1000]) == b.owners("ns", KEYS[:1000])


def test_weights_scale_share():
    ring = HashRing({"small": 1.0, "big": 3.0})
    c, _ = counts(ring)
    assert 2.6 <= c["big"] / c["small"] <= 3.4


def test_namespace_changes_placement():
    ring = HashRing({f"n{i}": 1.0 for i in range(4)})
    assert ring.owners("a", KEYS[:2000]) != ring.owners("b", KEYS[:2000])


def test_bad_weights_and_empty_ring():
    with pytest.raises(ConfigError):
        HashRing({"a": 0.0})
    with pytest.raises(LookupError):
        HashRing({}).owner_indices(np.array([1], dtype=np.uint64))
