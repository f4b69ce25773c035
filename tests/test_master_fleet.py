"""A master holds hundreds of watch streams without a thread each: heartbeats stay fast, a new
client bootstraps in one round trip, and an epoch change reaches every watcher.

(The master used to run its gRPC service on 32 threads, one per watch stream for the stream's
life: the 33rd client waited for a timeout, heartbeats queued behind the streams.)
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from gcache import Client
from gcache.cluster import LocalCluster
from gcache.meta import rpc
from gcache.meta.master_client import AuthFailed, MasterClient
from tests.conftest import poll

WATCHERS = 250


class Watchers:
    """WATCHERS watch streams, each on its own connection, on an event loop in a thread."""

    def __init__(self, address: str, token: str, n: int) -> None:
        self.address, self.token, self.n = address, token, n
        self.epochs: dict[int, int] = {}
        self.errors: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._channels: list = []

    async def _one(self, i: int) -> None:
        ch = grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)])
        self._channels.append(ch)
        call = ch.unary_stream(f"/{rpc.SERVICE}/WatchMembership", request_serializer=rpc.pack,
                               response_deserializer=rpc.unpack)({}, metadata=((rpc.TOKEN_HEADER, self.token),))
        try:
            async for m in call:
                self.epochs[i] = m["epoch"]
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(repr(exc))

    def start(self) -> Watchers:
        self._thread.start()
        for i in range(self.n):
            asyncio.run_coroutine_threadsafe(self._one(i), self.loop)
        return self

    def stop(self) -> None:
        async def close() -> None:
            for ch in self._channels:
                await ch.close()
        asyncio.run_coroutine_threadsafe(close(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)




@pytest.fixture
def master(tmp_path):
    c = LocalCluster(nodes=0, masters=1, root=str(tmp_path))
    c.start()
    yield c
    c.stop()


def test_hundreds_of_watchers_heartbeats_stay_fast_and_clients_bootstrap(master):
    address = master.master_procs[0].address
    mc = MasterClient(master.master_url, master.token, timeout_s=2.0)
    out = mc.call("Register", {"node": "n0", "address": "127.0.0.1:1", "capacity": 1 << 30}, timeout_s=5.0)
    watchers = Watchers(address, master.token, WATCHERS).start()
    try:
        assert poll(lambda: len(watchers.epochs) == WATCHERS, 60), f"{len(watchers.epochs)} of {WATCHERS} attached"
        assert mc.call("Status", {})["master"]["watchers"] >= WATCHERS
        brief = mc.call("Status", {"brief": True})  # no per-node rows: cheap to poll
        assert set(brief) == {"master"} and brief["master"]["is_leader"] and brief["master"]["epoch"] >= 1

        # heartbeats are answered at once, not after the streams
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            assert mc.call("Heartbeat", {"node": "n0", "inc": out["inc"], "epoch": 0}, timeout_s=2.0)["ok"]
            times.append(time.perf_counter() - t0)
        times.sort()
        assert times[-1] < 1.0, f"slowest heartbeat {times[-1]:.3f}s"

        # a new client is usable after one round trip, with hundreds of streams open
        t0 = time.perf_counter()
        with Client(master.master_url, token=master.token, timeout_s=1.0) as c:
            took = time.perf_counter() - t0
            assert c.membership.epoch == out["epoch"] and list(c.membership.owners()) == ["n0"]
        assert took < 2.0, f"bootstrap took {took:.2f}s"

        # a watcher that re-attaches with the current epoch gets a short "unchanged" first
        first = next(iter(mc.watch(address, known=out["epoch"])))
        assert first == {"epoch": out["epoch"], "unchanged": True}

        # an epoch change reaches every watcher
        new = mc.call("Register", {"node": "n1", "address": "127.0.0.1:2", "capacity": 1 << 30}, timeout_s=5.0)
        assert poll(lambda: all(e >= new["epoch"] for e in watchers.epochs.values()), 30)
        assert not watchers.errors
    finally:
        watchers.stop()
        mc.close()


def test_a_client_with_the_wrong_token_fails_fast_and_says_so(master):
    t0 = time.monotonic()
    with pytest.raises(AuthFailed):
        Client(master.master_url, token="not-the-token")
    assert time.monotonic() - t0 < 5.0


def test_a_client_follows_epochs_through_deltas(master):
    mc = MasterClient(master.master_url, master.token, timeout_s=2.0)
    mc.call("Register", {"node": "a", "address": "127.0.0.1:1", "capacity": 1 << 30}, timeout_s=5.0)
    with Client(master.master_url, token=master.token) as c:
        raw = mc.watch(master.master_procs[0].address, known=c.membership.epoch)
        it = iter(raw)
        assert next(it)["unchanged"]
        out = mc.call("Register", {"node": "b", "address": "127.0.0.1:2", "capacity": 1 << 30}, timeout_s=5.0)
        d = next(it)
        assert d["delta"] == out["epoch"] - 1 and [r["id"] for r in d["nodes"]] == ["b"]
        assert poll(lambda: c.membership.epoch == out["epoch"], 10)
        assert sorted(c.membership.owners()) == ["a", "b"] and c.membership.previous is not None
        mc.call("Drain", {"node": "b"}, timeout_s=5.0)
        assert poll(lambda: c.membership.owners().keys() == {"a"}, 10)
        raw.cancel()
    mc.close()


def test_a_watcher_re_attaches_over_its_standby_connection_when_its_master_dies(tmp_path, monkeypatch):
    """Once attached, a watcher opens a connection to the master it would try next (a few seconds
    later: here at once) and, when its master is killed, re-attaches there over that connection."""
    from gcache.client import routing
    from gcache.client.routing import MembershipWatcher

    monkeypatch.setattr(routing, "STANDBY_AFTER_S", (0.0, 0.0))
    monkeypatch.setattr(routing, "REATTACH_SPREAD_S", 0.1)
    c = LocalCluster(nodes=0, masters=3, root=str(tmp_path))
    c.start()
    mc = MasterClient(c.master_url, c.token, timeout_s=2.0)
    seen: list[int] = []
    w = MembershipWatcher(MasterClient(c.master_url, c.token), lambda m: seen.append(m.epoch), standby=True)
    try:
        mc.call("Register", {"node": "n0", "address": "127.0.0.1:1", "capacity": 1 << 30}, timeout_s=5.0)
        w.start()
        assert w.wait_first(10.0) and w.address
        order = w.masters.addresses
        standby = [a for a in order if a != w.address]
        assert poll(lambda: sum(w.masters.prepared(a) for a in standby) == 1, 5), "no standby connection"
        (ready,) = [a for a in standby if w.masters.prepared(a)]
        watched = next(i for i, m in enumerate(c.master_procs) if m.address == w.address)
        c.kill(watched, master=True)
        assert poll(lambda: w.attaches == 2, 10), "did not re-attach"
        assert w.address == ready  # the master whose connection was open
    finally:
        w.stop()
        mc.close()
        c.stop()
