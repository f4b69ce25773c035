"""Membership deltas rebuild exactly what a watcher routes by, over random command sequences."""

from __future__ import annotations

import random

import pytest

from gcache.meta import rpc
from gcache.meta.delta import apply, diff, routing_view
from gcache.meta.membership import Membership
from gcache.meta.nodetable import CommandError, GiB, NodeTable


def random_commands(rng: random.Random, n: int):
    names = [f"n{i}" for i in range(12)]
    for _ in range(n):
        node = rng.choice(names)
        op = rng.choice(["register", "register", "set_state", "drain", "handover_done", "handover_done"])
        if op == "register":
            yield {"op": op, "node": node, "address": f"10.0.0.{names.index(node)}:7400",
                   "capacity": rng.choice([1, 64, 1088]) * GiB}
        elif op == "set_state":
            yield {"op": op, "node": node, "inc": rng.randint(0, 3), "state": rng.choice(["up", "suspect", "down"])}
        elif op == "handover_done":
            yield {"op": op, "node": node, "epoch": rng.randint(0, 200)}
        else:
            yield {"op": op, "node": node}


@pytest.mark.parametrize("seed", range(20))
def test_apply_of_diff_rebuilds_every_epoch(seed):
    rng = random.Random(seed)
    t = NodeTable()
    prev = t.membership()
    held = prev  # what a watcher following every epoch holds
    sizes = []
    for cmd in random_commands(rng, 150):
        try:
            t.apply({"v": 1, **cmd})
        except CommandError:
            continue
        cur = t.membership()
        if cur["epoch"] == prev["epoch"]:
            continue
        d = diff(prev, cur)
        d = rpc.unpack(rpc.pack(d))  # as it travels
        held = apply(held, d)
        assert held == routing_view(cur)
        assert Membership.from_master(held) == Membership.from_master(cur)
        sizes.append((len(rpc.pack(d)), len(rpc.pack(cur))))
        prev = cur
    assert sizes and sum(a for a, _ in sizes) < sum(b for _, b in sizes)


def test_a_delta_for_another_epoch_is_refused():
    t = NodeTable()
    m0 = t.membership()
    t.apply({"v": 1, "op": "register", "node": "a", "address": "10.0.0.1:1", "capacity": GiB})
    m1 = t.membership()
    t.apply({"v": 1, "op": "register", "node": "b", "address": "10.0.0.2:1", "capacity": GiB})
    with pytest.raises(ValueError, match="does not apply"):
        apply(m0, diff(m1, t.membership()))


def test_a_join_in_a_large_fleet_is_a_small_message():
    t = NodeTable()
    for i in range(500):
        t.apply({"v": 1, "op": "register", "node": f"d{i:04d}", "address": f"10.0.{i // 250}.{i % 250}:7400",
                 "capacity": 1088 * GiB})
    t.apply({"v": 1, "op": "handover_done_many", "reports": [{"node": f"d{i:04d}", "epoch": t.epoch}
                                                              for i in range(500)]})
    before = t.membership()
    t.apply({"v": 1, "op": "register", "node": "new", "address": "10.0.9.9:7400", "capacity": 1088 * GiB})
    full, d = rpc.pack(t.membership()), rpc.pack(diff(before, t.membership()))
    assert len(full) > 40_000 and len(d) < 500, (len(full), len(d))
