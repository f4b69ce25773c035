"""Three real daemons on loopback, driven through gcache.Client."""

import os
import signal
import time

import numpy as np
import pytest

from gcache import CallTimeout, Client, ConnectionFailed, OnNodeError, Status
from gcache.errors import GCacheError
from tests.conftest import poll, sigstop

MiB = 1 << 20


def sizes(n, rng):
    """Log-uniform 1 B .. 4 MiB, with both ends present."""
    s = np.exp(rng.uniform(0, np.log(4 * MiB), n)).astype(np.int64)
    s[0], s[1] = 1, 4 * MiB
    return s


def test_10k_keys_of_1B_to_4MiB_round_trip_byte_exact(make_cluster):
    # ~2.8 GB of values: 2 GiB a node leaves room for an uneven ring share and arena
    # fragmentation (at 1 GiB a node could fill and evict, which a cache may do, failing the test)
    c = make_cluster(mem="2GiB", extra_args=["--no-pretouch"])
    rng = np.random.default_rng(7)
    n = 10_000
    sz = sizes(n, rng)
    blob = rng.integers(0, 256, int(sz.max()) + n, dtype=np.uint8)
    offs = rng.integers(0, n, n)
    keys = [f"page/{i}" for i in range(n)]
    values = [blob[o:o + s] for o, s in zip(offs, sz)]
    with Client(c.addresses, timeout_s=30) as client:
        for i in range(0, n, 64):
            assert all(s is Status.OK for s in client.put(keys[i:i + 64], values[i:i + 64]))
        dest = np.empty(int(sz.max()), dtype=np.uint8)
        for i in range(0, n, 64):
            bufs = [np.empty(int(s), dtype=np.uint8) for s in sz[i:i + 64]]
            res = client.get_into(keys[i:i + 64], bufs)
            assert res.hits == len(bufs)
            assert res.sizes == [int(s) for s in sz[i:i + 64]]
            for b, v in zip(bufs, values[i:i + 64]):
                assert np.array_equal(b, v)
        # a buffer that is too small is reported, and the connection stays in sync
        res = client.get_into([keys[1], keys[2]], [dest[:10], np.empty(int(sz[2]), np.uint8)])
        assert res.status[0] is Status.BUFFER_TOO_SMALL and res.sizes[0] == 4 * MiB
        assert res.status[1] is Status.OK
        stats = client.stats()
        assert sum(s["ram_keys"] for s in stats.values()) == n
        assert all(s["ram_keys"] > n / 5 for s in stats.values())  # spread over all three


def test_memory_pressure_demotes_and_restart_serves_disk_keys(make_cluster):
    c = make_cluster(mem="8MiB", disk="256MiB")
    rng = np.random.default_rng(1)
    keys = [f"k{i}" for i in range(400)]
    values = [rng.integers(0, 256, 256 * 1024, dtype=np.uint8) for _ in keys]  # 100 MiB over 24 MiB of RAM
    with Client(c.addresses, timeout_s=10) as client:
        for i in range(0, len(keys), 16):
            assert all(s is Status.OK for s in client.put(keys[i:i + 16], values[i:i + 16]))
        got = client.get(keys)
        assert all(g is not None and bytes(g) == v.tobytes() for g, v in zip(got, values))
        stats = client.stats()
        assert sum(s.get("demotions", 0) for s in stats.values()) > 200
        assert sum(s.get("hits_nvme", 0) for s in stats.values()) > 0

        node0 = c.daemons[0].node_id
        mine = [i for i, o in enumerate(client.owners(keys)) if o == c.addresses[0]]

        def demote_queue_empty():
            s = client.stats()[c.addresses[0]]
            return s["demote_queue_bytes"] == 0 and s["disk_keys"] > 0
        assert poll(demote_queue_empty, 10), "demotions did not finish"
        on_disk = client.stats()[c.addresses[0]]["disk_keys"]
        c.kill(0, signal.SIGKILL)
        c.restart(0)
        got = client.get([keys[i] for i in mine])
        hits = [g for g in got if g is not None]
        assert len(hits) >= on_disk > 0, f"{node0}: {len(hits)} hits after restart, {on_disk} were on disk"
        for i, g in zip(mine, got):
            if g is not None:
                assert bytes(g) == values[i].tobytes()


def test_namespace_isolation(cluster):
    a = Client(cluster.addresses, namespace="tenant-a")
    b = Client(cluster.addresses, namespace="tenant-b")
    assert a.put_one("shared-key", b"secret of a") is Status.OK
    assert b.get_one("shared-key") is None
    assert b.exists(["shared-key"]) == [False]
    assert b.delete(["shared-key"]) == [False]
    assert a.get_one("shared-key") == b"secret of a"
    assert a.get_one("shared-key", namespace="tenant-b") is None


def test_ttl_and_delete_through_the_client(cluster):
    with Client(cluster.addresses) as client:
        client.put(["t1", "t2"], [b"a", b"b"], ttl_s=0.1)
        client.put_one("keep", b"c")
        assert poll(lambda: not any(client.exists(["t1", "t2"])), 5), "the TTL'd keys did not expire"
        assert client.delete(["keep", "never"]) == [True, False]
        assert client.get_one("keep") is None


def test_per_key_errors_in_a_batch(make_cluster):
    c = make_cluster(extra_args=["--max-value", "1MiB"])
    with Client(c.addresses) as client:
        st = client.put([b"ok", b"", b"x" * 2000, b"big", b"ok2"],
                        [b"1", b"2", b"3", np.zeros(MiB + 1, np.uint8), b"5"])
        assert st == [Status.OK, Status.BAD_KEY, Status.BAD_KEY, Status.TOO_LARGE, Status.OK]
        assert client.get([b"ok", b"big", b"ok2"]) == [b"1", None, b"5"]


def test_accepts_numpy_bytearray_memoryview_and_tensors(cluster):
    with Client(cluster.addresses) as client:
        arr = np.arange(1000, dtype=np.float32)
        client.put(["np", "ba", "mv"], [arr, bytearray(b"abc"), memoryview(b"xyz")])
        out = np.zeros(1000, dtype=np.float32)
        assert client.get_into(["np"], [out]).hits == 1 and np.array_equal(out, arr)
        with pytest.raises(ValueError):
            client.put(["strided"], [arr[::2]])
        with pytest.raises(TypeError):
            client.get_into(["ba"], [b"read-only"])
        torch = pytest.importorskip("torch", reason="torch extra not installed")
        t = torch.arange(64, dtype=torch.bfloat16)
        client.put(["t"], [t])
        back = torch.zeros(64, dtype=torch.bfloat16)
        assert client.get_into(["t"], [back]).hits == 1 and torch.equal(back, t)


def test_dead_node_raises_typed_error_or_becomes_misses(cluster):
    keys = [f"k{i}" for i in range(60)]
    with Client(cluster.addresses, timeout_s=1.0) as client:
        client.put(keys, [b"v"] * len(keys))
        owners = client.owners(keys)
        dead = cluster.addresses[1]
        cluster.kill(1)
        t0 = time.monotonic()
        with pytest.raises(ConnectionFailed):
            client.get(keys)
        assert time.monotonic() - t0 < 1.5
    with Client(cluster.addresses, timeout_s=1.0, on_node_error=OnNodeError.MISS) as client:
        got = client.get(keys)
        for g, o in zip(got, owners):
            assert (g is None) if o == dead else (g == b"v")
        st = client.put(keys, [b"w"] * len(keys))
        assert all((s is Status.UNAVAILABLE) == (o == dead) for s, o in zip(st, owners))


def test_stopped_node_times_out_within_the_call_timeout(cluster):
    keys = [f"k{i}" for i in range(30)]
    with Client(cluster.addresses, timeout_s=1.0, on_node_error=OnNodeError.MISS) as client:
        client.put(keys, [b"v"] * len(keys))
        owners = client.owners(keys)
        pid = cluster.daemons[2].pid
        sigstop(pid)
        try:
            t0 = time.monotonic()
            got = client.get(keys)
            elapsed = time.monotonic() - t0
            assert elapsed < 1.5  # the call timeout, plus slack for a loaded 2-core machine
            stopped = cluster.addresses[2]
            assert all((g is None) == (o == stopped) for g, o in zip(got, owners))
            strict = Client(cluster.addresses, timeout_s=0.3)
            with pytest.raises(CallTimeout):
                strict.get(keys)
            strict.close()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert client.get(keys) == [b"v"] * len(keys)  # fresh connections after the timeout


def test_a_cluster_that_fails_to_start_stops_every_process_it_started():
    from gcache.cluster import LocalCluster

    cl = LocalCluster(nodes=2, mem="32MiB", start_timeout_s=0.0)  # no daemon can be ready in time
    with pytest.raises(GCacheError, match="not ready"):
        cl.start()
    assert len(cl.daemons) == 2
    assert all(d.proc is not None and d.proc.poll() is not None for d in cl.daemons)
    assert not os.path.exists(cl.root)
