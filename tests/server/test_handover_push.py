"""gcache.server.handover on a real Store with put functions standing in for the client: what a
previous owner keeps after pushing."""

import pytest

from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing
from gcache.protocol import Status
from gcache.server.handover import HandoverStopped, hand_over, held_unowned
from gcache.tier.store import Store, StoreConfig
from tests.conftest import read

NS = "ns"


@pytest.fixture
def store():
    s = Store(StoreConfig(mem_bytes=8 << 20, pretouch=False))
    yield s
    s.close()


def fill(store, n=64):
    keys = [b"k%d" % i for i in range(n)]
    for k in keys:
        assert store.put((NS, k), b"old") is Status.OK
    return keys


def test_a_copy_the_new_owner_did_not_take_is_not_kept(store):
    """Pushed or refused (the new owner failed, or refused the value as too large), the previous
    owner keeps no copy: it would serve it again once the ring gives the key back."""
    keys = fill(store)
    ring = HashRing({"n0": 1.0, "n1": 1.0})
    lost = [k for k in keys if ring.owner(NS, k) == "n1"]
    assert 0 < len(lost) < len(keys)
    asked = []

    def put(membership, ns, pool, ks, values, records):
        asked.extend(ks)
        return [Status.OK if i % 2 else Status.UNAVAILABLE for i in range(len(ks))]

    moved = hand_over(store, Membership(epoch=2, nodes=()), ring, "n0", put, batch=8)
    assert sorted(asked) == sorted(lost) and moved == sum(len(lost[i:i + 8]) // 2 for i in range(0, len(lost), 8))
    assert [k for k in keys if store.exists((NS, k))] == [k for k in keys if k not in lost]


def test_a_push_that_raises_keeps_its_copies_for_the_retry(store):
    keys = fill(store, 16)
    ring = HashRing({"n0": 1.0, "n1": 1.0})

    def put(*_args):
        raise RuntimeError("no route")

    with pytest.raises(RuntimeError):
        hand_over(store, Membership(epoch=2, nodes=()), ring, "n0", put)
    assert all(store.exists((NS, k)) for k in keys)


def test_a_node_fenced_mid_handover_pushes_no_further_batch(store):
    """The handover loop checked the fence once, before the whole handover: a previous owner
    stopped mid-handover, declared down meanwhile (a clear skipped it), then resumed, pushed
    its next batches of pre-clear values before it learned it was fenced."""
    keys = fill(store)
    ring = HashRing({"n0": 1.0, "n1": 1.0})
    lost = [k for k in keys if ring.owner(NS, k) == "n1"]
    assert len(lost) > 8
    asked = []

    def put(membership, ns, pool, ks, values, records):
        asked.extend(ks)
        return [Status.OK] * len(ks)

    with pytest.raises(HandoverStopped, match="fenced after 8 keys"):
        hand_over(store, Membership(epoch=2, nodes=()), ring, "n0", put, batch=8, fenced=lambda: len(asked) >= 8)
    assert len(asked) == 8
    assert sum(store.exists((NS, k)) for k in lost) == len(lost) - 8  # the rest kept for the retry


def test_a_value_written_here_while_it_was_pushed_is_kept(store):
    keys = fill(store, 16)
    ring = HashRing({"n1": 1.0})  # n0 owns nothing

    rewritten = []

    def put(membership, ns, pool, ks, values, records):
        rewritten.append(ks[0])
        store.put((NS, ks[0]), b"newer")  # e.g. a client still routing by the old ring
        return [Status.UNAVAILABLE] * len(ks)

    hand_over(store, Membership(epoch=2, nodes=()), ring, "n0", put, batch=16)
    assert [k for k in keys if store.exists((NS, k))] == rewritten and read(store, (NS, rewritten[0])) == b"newer"


def test_held_unowned_names_the_copies_whose_owner_in_between_changes(store):
    keys = fill(store, 400)
    two = HashRing({"n0": 1.0, "n1": 1.0})
    three, four = HashRing({"n0": 1.0, "n1": 1.0, "n2": 1.0}), HashRing({"n0": 1.0, "n1": 1.0, "n2": 1.0, "n3": 1.0})
    # n2 leaves: every key n0 held that n2 owned comes back (to n0 or n1)
    back = {k for k in keys if three.owner(NS, k) == "n2"}
    assert back and {k for _ns, k in held_unowned(store, three, two, "n0")} == back | {
        k for k in keys if three.owner(NS, k) == "n1" and two.owner(NS, k) != "n1"}
    # n3 joins: of the copies n0 had not pushed yet, those n3 takes; those whose owner stays
    # (n1 or n2) are still pushed there
    moving = {k for k in keys if three.owner(NS, k) != "n0" and four.owner(NS, k) != three.owner(NS, k)}
    assert moving and {k for _ns, k in held_unowned(store, three, four, "n0")} == moving
    staying = {k for k in keys if three.owner(NS, k) != "n0" and four.owner(NS, k) == three.owner(NS, k)}
    assert staying and not staying & moving
    assert held_unowned(store, two, HashRing({"n0": 1.0, "n1": 1.0}), "n0") == []  # the same ring
    assert held_unowned(store, None, two, "n0") == []  # no ring before: nothing to compare
    # a node the ring before left out (draining) owned nothing there: what changes owner
    drained = {k for k in keys if HashRing({"n1": 1.0, "n2": 1.0}).owner(NS, k) != three.owner(NS, k)}
    assert {k for _ns, k in held_unowned(store, HashRing({"n1": 1.0, "n2": 1.0}), three, "n0")} == drained
