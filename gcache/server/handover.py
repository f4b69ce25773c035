"""Active handover: push every key this node no longer owns to its new owner, hottest first.

Fed with a put function (:data:`PutFn`) rather than a client, so this module knows nothing of
how the copies travel: the daemon wires in gcache.client.handover.ClientPut (the gcache client,
over TCP, each copy flagged as a handover so the receiver stores it only where no client wrote
or deleted the key meanwhile, gcache.server.touchlog). Each pushed value carries its
value-metadata record (pool, chain position, tail mark, what is left of the TTL, format tag),
and is deleted here once stored there, unless a newer value was written here meanwhile.

A copy its new owner did not take (that node failed, refused the value, or was gone) is deleted
here too: kept, it would come back as this node's value once the ring gives the key back (the
other node leaves or fails), though that node may have acknowledged newer writes of the key
meanwhile. For the same reason, at the next change of the ring a node drops every copy of a
key the ring before gave another node whose owner changes (``held_unowned``): one it takes
back, or one a handover has not pushed yet and whose owner moves on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from itertools import pairwise

import numpy as np

from gcache.errors import GCacheError
from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing, key_hashes
from gcache.protocol import Status
from gcache.tier.store import Store
from gcache.tier.valuemeta import ValueMeta

BATCH = 32  # keys per push

# put(membership, namespace, pool, keys, values, records) -> one Status per key: store each value
# with its record on the key's owner under ``membership`` (all keys share ``pool``).
PutFn = Callable[[Membership, str, "str | None", Sequence[bytes], Sequence[memoryview], Sequence[ValueMeta]],
                 list[Status]]


class HandoverStopped(GCacheError):
    """The node was fenced in the middle of a handover: the rest waits for the retry."""


def hand_over(store: Store, membership: Membership, ring: HashRing, node_id: str, put: PutFn,
              batch: int = BATCH, fenced: Callable[[], bool] = lambda: False) -> int:
    """Push every key of ``store`` that ``ring`` says ``node_id`` no longer owns; returns how
    many moved. A put error propagates (the caller retries the whole handover later). ``fenced``
    is asked before each batch: a node stopped mid-handover and declared down meanwhile may hold
    values a client has since deleted or cleared elsewhere, so it pushes nothing more once it
    knows it is fenced (HandoverStopped)."""
    by_ns: dict[str, list[bytes]] = defaultdict(list)
    for ns, key in store.keys_hottest_first():
        if ring.owner(ns, key) != node_id:
            by_ns[ns].append(key)
    moved = 0
    for ns, keys in by_ns.items():
        for i in range(0, len(keys), batch):
            if fenced():
                raise HandoverStopped(f"fenced after {moved} keys were handed over: the rest waits for the masters")
            moved += push(store, membership, ns, keys[i:i + batch], put)
    return moved


def push(store: Store, membership: Membership, ns: str, keys: Sequence[bytes], put: PutFn) -> int:
    """Put ``keys`` on their new owners, then delete each value here, pushed or not, unless a
    newer one was written here meanwhile. Returns how many moved."""
    present = []
    for k in keys:
        hit = store.acquire((ns, k), bounded=False)  # at most BATCH values at a time
        if hit is not None:
            present.append((k, hit))
    by_pool: dict[str | None, list[int]] = defaultdict(list)
    for i, (_k, hit) in enumerate(present):
        by_pool[hit.meta.pool].append(i)
    moved = 0
    try:
        for pool, idxs in by_pool.items():
            sel = [present[i] for i in idxs]
            status = put(membership, ns, pool, [k for k, _ in sel], [h.view for _, h in sel], [h.meta for _, h in sel])
            moved += sum(st is Status.OK for st in status)
    finally:
        store.release_many([hit for _k, hit in present])
    for k, hit in present:  # an error above (put raised) leaves them for the handover's retry
        store.delete((ns, k), if_seq=hit.seq)
    return moved


def held_unowned(store: Store, before: HashRing | None, ring: HashRing | None,
                 node_id: str) -> list[tuple[str, bytes]]:
    """At a change of the ring from ``before`` to ``ring``: the keys ``store`` holds that
    ``before`` gave another node and that change owner now. Some ``ring`` gives back to this
    node (a joiner failed or left before the handover to it finished); the others are copies of
    keys lost in an earlier change, not handed over yet, whose owner moves on now. Their owner
    under ``before`` may have acknowledged newer writes: served, or pushed to the new owner
    (whose touch log knows nothing of those writes), a copy could be older than what was
    acknowledged. (One whose owner stays is still pushed to it: that node's touch log knows its
    own writes.) Empty when either ring is missing or they are the same."""
    if before is None or ring is None:
        return []
    return held_moved(store, [before, ring], node_id)


def held_moved(store: Store, rings: Sequence[HashRing], node_id: str) -> list[tuple[str, bytes]]:
    """held_unowned over several changes of the ring at once, ``rings[0]`` (the one this node
    routed by) to ``rings[-1]`` (the one it is about to route by), for a node that missed the
    ones in between. Kept: a key whose owner never changed (this node's, or a copy not handed
    over yet, pushed to that owner), and one this node owned until a single change gave it to
    another node for good (pushed there: that node's touch log knows every write it took).
    Dropped: a key whose owner changed twice or more (a node in between may have taken writes
    the last owner's touch log never saw), and one another node owned when the owner changed
    (it may have taken writes)."""
    if len(rings) < 2 or all(r.same_as(rings[0]) for r in rings[1:]):
        return []
    ids = sorted({n for r in rings for n in r.node_ids})
    me = ids.index(node_id) if node_id in ids else -1
    as_ids = [np.array([ids.index(n) for n in r.node_ids], np.intp) for r in rings]  # ring index -> id index
    by_ns: dict[str, list[bytes]] = defaultdict(list)
    for ns, key in store.keys_hottest_first():
        by_ns[ns].append(key)
    out = []
    for ns, keys in by_ns.items():
        hashes = key_hashes(ns, keys)  # once for all rings
        owners = [m[r.owner_indices(hashes)] for r, m in zip(rings, as_ids)]
        changes = np.zeros(len(keys), dtype=np.intp)
        for a, b in pairwise(owners):
            changes += a != b
        drop = (changes >= 2) | ((changes == 1) & (owners[0] != me))
        out += [(ns, keys[i]) for i in np.flatnonzero(drop).tolist()]
    return out
