"""The membership lease rule (gcache.server.lease) and the rejoin drop (Store.drop_all), without
sockets. The same rules over real processes: tests/test_ha.py and tests/test_faultlab.py."""

import os

from gcache.meta.nodetable import COMMAND_VERSION, NodeTable
from gcache.server.lease import PeerAnswer, Verdict, judge, outage_confirmed
from gcache.tier.nvme import NvmeTier
from gcache.tier.store import Store, StoreConfig

OK_FOLLOWER = {"ok": True, "epoch": 5, "leader": False}
OK_LEADER = {"ok": True, "epoch": 5, "leader": True}
DOWN_FOLLOWER = {"ok": False, "reason": "declared down", "epoch": 6, "leader": False}
DOWN_LEADER = {"ok": False, "reason": "declared down", "epoch": 6, "leader": True}
STALE_FOLLOWER = {"ok": False, "reason": "stale incarnation", "epoch": 6, "leader": False}


def test_only_the_leader_renews_the_lease():
    assert judge([OK_FOLLOWER, OK_LEADER, OK_FOLLOWER]) == (Verdict.RENEW, OK_LEADER)
    # a majority of followers is not enough: only the leader declares nodes down
    assert judge([OK_FOLLOWER, OK_FOLLOWER])[0] is Verdict.ASK_PEERS
    assert judge([])[0] is Verdict.ASK_PEERS


def test_declared_down_fences_and_rejoins_only_through_the_leader():
    assert judge([DOWN_LEADER, DOWN_FOLLOWER]) == (Verdict.REJOIN, DOWN_LEADER)
    # followers say so, the leader is out of reach: stay out rather than rejoin through them
    assert judge([DOWN_FOLLOWER, OK_FOLLOWER])[0] is Verdict.WAIT_FOR_LEADER
    # a lagging follower that has not applied our registration yet is no reason to register again
    assert judge([STALE_FOLLOWER, OK_LEADER])[0] is Verdict.RENEW
    assert judge([STALE_FOLLOWER])[0] is Verdict.ASK_PEERS


def test_two_leaders_briefly_the_newer_one_decides():
    stale_leader = {"ok": True, "epoch": 5, "leader": True}  # cut off in a minority, not stepped down yet
    assert judge([stale_leader, DOWN_LEADER]) == (Verdict.REJOIN, DOWN_LEADER)


def test_outage_needs_every_peer_to_answer_and_none_to_reach_a_leader():
    quiet = PeerAnswer(leader=False, epoch=7)
    assert outage_confirmed(7, [quiet, quiet])  # the master outage case: keep serving
    assert not outage_confirmed(7, [quiet, PeerAnswer(leader=True, epoch=7)])  # we are cut off
    assert not outage_confirmed(7, [quiet, None])  # a silent peer: cannot tell
    assert not outage_confirmed(7, [quiet, PeerAnswer(leader=False, epoch=8)])  # membership moved on
    assert not outage_confirmed(7, [])  # nobody to ask


def test_peer_answer_parsing():
    assert PeerAnswer.from_reply({"lead": True, "ep": 3}) == PeerAnswer(True, 3)
    assert PeerAnswer.from_reply({"node": "n", "ep": 3}) is None  # a daemon without masters
    assert PeerAnswer.from_reply({"lead": 1, "ep": 3}) is None


def test_register_reports_the_previous_incarnations_state():
    t = NodeTable()
    reg = {"v": COMMAND_VERSION, "op": "register", "node": "a", "address": "h:1", "capacity": 1 << 30}
    assert t.apply(reg)["was"] is None
    assert t.apply(reg)["was"] == "up"  # a restart within down-after: nobody else owned its ranges
    t.apply({"v": COMMAND_VERSION, "op": "set_state", "node": "a", "inc": 2, "state": "down"})
    assert t.apply(reg)["was"] == "down"


def test_drop_all_forgets_ram_queue_and_disk_also_across_a_restart(tmp_path):
    disk = str(tmp_path / "d")
    cfg = StoreConfig(mem_bytes=1 << 20, disk_dir=disk, disk_bytes=16 << 20, pretouch=False)
    store = Store(cfg)
    vals = {("ns", f"k{i}".encode()): os.urandom(64 << 10) for i in range(40)}  # 2.5 MiB over 1 MiB
    for k, v in vals.items():
        store.put(k, v)
    held = store.acquire(next(reversed(vals)))  # a reader mid-copy keeps its slot until release
    assert held is not None
    assert store.flush() and store.stats()["disk_keys"] > 0
    assert store.drop_all() >= len(vals)
    assert all(store.acquire(k) is None and not store.exists(k) for k in vals)
    store.release(held)
    assert store.stats()["ram_used"] == 0
    store.put(("ns", b"new"), b"after")  # the store is still usable
    store.close()
    again = NvmeTier(disk, 16 << 20)  # nothing comes back after a restart
    assert all(again.lookup(k) is None for k in vals)
    again.close()
