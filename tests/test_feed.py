"""What a master's front sends a watcher (gcache.meta.feed): a watcher that fell several epochs
behind, or re-attaches holding an older epoch, gets a delta from the epoch it holds (while the
front still has it), not the whole membership, and rebuilds exactly what it routes by."""

from __future__ import annotations

import asyncio
import random

from gcache.meta import rpc
from gcache.meta.delta import apply, routing_view
from gcache.meta.feed import OLDER_PER_EPOCH, MembershipFeed
from gcache.meta.nodetable import CommandError, GiB, NodeTable
from tests.test_delta import random_commands


def _epochs(n_nodes: int = 200, seed: int = 1):
    """A fleet of ``n_nodes`` registered, then random changes: the memberships, by epoch."""
    t = NodeTable()
    for i in range(n_nodes):
        t.apply({"v": 1, "op": "register", "node": f"d{i}", "address": f"10.0.{i // 250}.{i % 250}:7400",
                 "capacity": 64 * GiB})
    out = {t.membership()["epoch"]: t.membership()}
    for cmd in random_commands(random.Random(seed), 120):
        try:
            t.apply({"v": 1, **cmd})
        except CommandError:
            continue
        m = t.membership()
        out[m["epoch"]] = m
    return out


def test_a_watcher_epochs_behind_gets_a_delta_from_what_it_holds():
    async def main() -> None:
        ms = _epochs()
        feed = MembershipFeed(history=8)
        epochs = sorted(ms)
        for e in epochs:
            feed.offer(e, rpc.pack(ms[e]))
        snap = feed.current
        assert snap.epoch == epochs[-1]
        for known in epochs[-8:-1]:  # still held here: a delta that rebuilds the current view
            raw = feed.payload(snap, known)
            d = rpc.unpack(raw)
            assert d["delta"] == known and len(raw) < len(snap.encoded) / 2
            assert apply(routing_view(ms[known]), d) == routing_view(ms[snap.epoch])
            assert feed.payload(snap, known) is raw  # made once, shared by every watcher at that epoch
        assert feed.payload(snap, epochs[-9]) == snap.encoded  # forgotten here: the whole membership
        assert feed.payload(snap, -1) == snap.encoded  # a new client
        many = MembershipFeed(history=len(epochs))  # a storm: late watchers at many epochs
        for e in epochs:
            many.offer(e, rpc.pack(ms[e]))
        late = [many.payload(many.current, k) for k in epochs[:-1]]
        # the delta from the epoch just before, and a bounded number from earlier ones
        assert sum(raw != many.current.encoded for raw in late) == 1 + OLDER_PER_EPOCH
        assert feed.payload(snap, snap.epoch + 5) == snap.encoded  # ahead of this master
        await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}))  # the fan-out tasks

    asyncio.run(main())
