"""The local shared-memory path: direct arena copies, leases, and fallback to TCP."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import xxhash

from gcache import Client, ConnectionFailed, LocalPath, Status
from gcache import protocol as P
from gcache.client import fanout
from gcache.net.address import is_local_host, unix_name
from gcache.transport import open_connection
from tests.conftest import poll, sigstop
from tests.test_local_batch import keys_of


def ram_used(client, node):
    return client.stats()[node]["ram_used"]


@pytest.mark.parametrize(("mode", "local_min_bytes"), [(LocalPath.FORCE, 0), (LocalPath.FORCE, 256 << 10),
                                                      (LocalPath.OFF, 0)])
def test_round_trips_byte_exact_on_both_paths(make_cluster, mode, local_min_bytes):
    """Local path: every request through the arena (0), or small ones inline over the Unix socket."""
    c = make_cluster(nodes=2, mem="64MiB")
    rng = np.random.default_rng(3)
    sizes = [0, 1, 63, 64, 4096, 100_000, 1 << 20, 3 << 20]
    keys = [f"v{s}" for s in sizes]
    vals = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    with Client(c.addresses, local=mode, connect_timeout_s=5.0,  # a loaded machine accepts slowly
                local_min_bytes=local_min_bytes) as cl:
        assert cl.put(keys, vals) == [Status.OK] * len(keys)
        out = [np.full(s + 7, 0xEE, np.uint8) for s in sizes]
        res = cl.get_into(keys, out)
        assert res.status == [Status.OK] * len(keys) and res.sizes == sizes
        for o, v in zip(out, vals):
            assert np.array_equal(o[:len(v)], v) and (o[len(v):] == 0xEE).all()
        # scatter: a value read into two buffers, and written from two
        a, b = np.empty(60_000, np.uint8), np.empty(40_000, np.uint8)
        assert cl.get_into(["v100000"], [[a, b]]).hits == 1
        assert np.array_equal(np.concatenate([a, b]), vals[5])
        assert cl.put(["two"], [[b"abc", b"defg"]]) == [Status.OK]
        assert cl.get_one("two") == b"abcdefg"
        small = np.empty(10, np.uint8)
        assert cl.get_into(["v4096"], [small]).status == [Status.BUFFER_TOO_SMALL]
        assert cl.get(["absent"]) == [None] and cl.exists(["v1", "absent"]) == [True, False]
        held = {n: s["ram_keys"] for n, s in cl.stats().items()}  # keys sit where the ring puts them
        assert {n for n, k in held.items() if k > 0} == set(cl.owners(keys + ["two"]))


def test_local_and_remote_owners_in_one_batch(make_cluster):
    local = make_cluster(nodes=1, mem="64MiB")
    remote = make_cluster(nodes=1, mem="64MiB", extra_args=["--no-local"])
    addrs = local.addresses + remote.addresses
    keys = [f"k{i}" for i in range(64)]
    vals = [os.urandom(10_000 + i) for i in range(64)]
    with Client(addrs, local=LocalPath.AUTO, connect_timeout_s=5.0) as cl:
        owners = set(cl.owners(keys))
        assert owners == set(addrs)
        assert cl.put(keys, vals) == [Status.OK] * 64
        assert [bytes(g) for g in cl.get(keys)] == vals
        conns = {n: cl._pool.get(n, n) for n in addrs}
        assert conns[local.addresses[0]].arena is not None  # shared memory
        assert conns[remote.addresses[0]].arena is None  # fell back to TCP
    with pytest.raises(ConnectionFailed):
        Client(remote.addresses, local=LocalPath.FORCE).get(["k1"])


def test_is_local_host():
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never this machine


def self_checking(rng, size):
    body = rng.integers(0, 256, size - 8, dtype=np.uint8)
    return np.concatenate([np.frombuffer(xxhash.xxh3_64_digest(body.tobytes()), np.uint8), body])


def test_readers_racing_an_evicting_writer_never_see_torn_values(make_cluster):
    c = make_cluster(nodes=1, mem="2MiB", extra_args=["--lease", "0.3"])
    addr = c.addresses[0]
    keys = [f"hot{i}" for i in range(24)]  # 24 x 128 KiB = 3 MiB through a 2 MiB arena
    stop = threading.Event()
    bad, hits, misses, writes = [], [0], [0], [0]

    def writer(seed):
        rng = np.random.default_rng(seed)
        with Client([addr], local=LocalPath.FORCE, timeout_s=5, local_min_bytes=0) as cl:
            while not stop.is_set():
                k = keys[int(rng.integers(len(keys)))]
                cl.put([k], [self_checking(rng, 128 * 1024)])
                writes[0] += 1

    def reader():
        out = [np.empty(128 * 1024, np.uint8) for _ in range(4)]
        rng = np.random.default_rng()
        with Client([addr], local=LocalPath.FORCE, timeout_s=5, local_min_bytes=0) as cl:
            while not stop.is_set():
                ks = [keys[int(i)] for i in rng.integers(0, len(keys), 4)]
                res = cl.get_into(ks, out)
                for st, o in zip(res.status, out):
                    if st is Status.OK:
                        hits[0] += 1
                        if xxhash.xxh3_64_digest(o[8:].tobytes()) != o[:8].tobytes():
                            bad.append(1)
                    else:
                        misses[0] += 1

    threads = [threading.Thread(target=writer, args=(s,)) for s in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    poll(lambda: hits[0] > 300 and writes[0] > 300, 20)
    stop.set()
    for t in threads:
        t.join()
    assert hits[0] > 300 and writes[0] > 300, (hits, writes)
    assert not bad, f"{len(bad)} torn values out of {hits[0]} hits"


def raw_local(addr, token=None):
    conn = open_connection("n", addr, 2.0, token, local=True)
    conn._timeout = 2.0
    return conn


def test_a_read_whose_lease_expired_is_reported_invalid(make_cluster):
    c = make_cluster(nodes=1, mem="8MiB", extra_args=["--lease", "0.3"])
    addr = c.addresses[0]
    with Client([addr], local=LocalPath.OFF) as cl:
        cl.put(["k"], [b"a" * 100_000])
        base = ram_used(cl, addr)
        conn = raw_local(addr)
        reply = conn.call(P.Op.LGET, {"ns": "default", "keys": [b"k"]}, time.monotonic() + 2)
        assert reply["st"] == [0] and reply["off"][0] >= 0 and reply["ls"]
        cl.put(["k"], [b"b" * 200_000])  # overwrite: the pinned old slot must stay allocated...
        assert ram_used(cl, addr) > base + 150_000
        # ...until the lease runs out and the reaper releases it
        assert poll(lambda: ram_used(cl, addr) < base + 150_000, 5)
        done = conn.call(P.Op.LDONE, {"ls": [reply["ls"]]}, time.monotonic() + 2)
        assert done["ok"] == [False]
        conn.close()



def test_lcommit_of_a_read_lease_is_refused_and_leaks_no_slot(make_cluster):
    """LCOMMIT naming an LGET lease: before, the daemon took the lease (so neither the reaper nor
    the disconnect could see it), committed nothing and never unpinned its hits: the slots stayed
    allocated for good, with no key in them, until the daemon restarted."""
    from gcache import ServerError

    c = make_cluster(nodes=1, mem="8MiB", extra_args=["--lease", "0.3"])
    addr = c.addresses[0]
    with Client([addr], local=LocalPath.OFF) as cl:
        base = ram_used(cl, addr)
        assert cl.put(["k"], [b"a" * 1_000_000]) == [Status.OK]
        conn = raw_local(addr)
        reply = conn.call(P.Op.LGET, {"ns": "default", "keys": [b"k"]}, time.monotonic() + 2)
        assert reply["st"] == [0] and reply["ls"]
        with pytest.raises(ServerError, match="read lease") as err:
            conn.call(P.Op.LCOMMIT, {"ls": reply["ls"]}, time.monotonic() + 2)
        assert err.value.code == P.ErrorCode.BAD_META
        done = conn.call(P.Op.LDONE, {"ls": [reply["ls"]]}, time.monotonic() + 2)
        assert done["ok"] == [True]  # still held after the refusal, released here
        conn.close()
        assert cl.delete(["k"]) == [True]
        assert poll(lambda: ram_used(cl, addr) == base, 5), f"{ram_used(cl, addr) - base} bytes never freed"


def test_a_get_whose_copy_outlasts_its_lease_reports_misses_not_torn_bytes(make_cluster, monkeypatch):
    """The batch's arena copies run once every owner has answered. Here they stall while another
    client overwrites the keys and the daemons' reapers release the expired leases (the old
    slots may now be reused): the client must not trust what it copied (LDONE with a reply, not
    one-way) and reports misses; the next get returns the new values, and no slot stays pinned."""
    c = make_cluster(nodes=2, mem="64MiB", extra_args=["--lease", "0.3"])
    old, new = [os.urandom(300_000) for _ in range(8)], [os.urandom(300_000) for _ in range(8)]
    real_copy = fanout.copy_all
    with Client(c.addresses, local=LocalPath.FORCE, local_min_bytes=0) as cl, \
            Client(c.addresses, local=LocalPath.OFF) as writer:
        keys = [k for a in c.addresses for k in keys_of(cl, a, 4, "k")]  # both daemons own some, whatever the ports
        assert len(set(cl.owners(keys))) == 2 and cl.put(keys, old) == [Status.OK] * 8
        settled = {a: ram_used(cl, a) for a in c.addresses}

        def stalled_copy(pairs):
            real_copy(pairs)
            assert writer.put(keys, new) == [Status.OK] * 8  # the pinned old slots stay allocated...
            # ...until the leases expire and the reapers free them
            assert poll(lambda: {a: ram_used(writer, a) for a in c.addresses} == settled, 5)

        monkeypatch.setattr(fanout, "copy_all", stalled_copy)
        res = cl.get_into(keys, [np.zeros(300_000, np.uint8) for _ in keys])
        assert res.status == [Status.NOT_FOUND] * 8
        monkeypatch.setattr(fanout, "copy_all", real_copy)
        assert [bytes(v) for v in cl.get(keys)] == new
        assert {a: ram_used(cl, a) for a in c.addresses} == settled

CLIENT_SCRIPT = r"""
import sys, time
from gcache.transport import open_connection
from gcache import protocol as P
addr = sys.argv[1]
conn = open_connection("n", addr, 2.0, None, local=True)
r = conn.call(P.Op.LALLOC, {"ns": "default", "keys": [b"a", b"b"], "sizes": [1 << 20, 1 << 20]},
              time.monotonic() + 2)
print(r["ls"], flush=True)
sys.stdin.readline()
r = conn.call(P.Op.LCOMMIT, {"ls": r["ls"]}, time.monotonic() + 2)
print("committed", r["st"], flush=True)
"""


@pytest.mark.parametrize("how", ["killed", "stalled"])
def test_a_client_dying_mid_put_leaks_no_slot(make_cluster, how):
    c = make_cluster(nodes=1, mem="16MiB", extra_args=["--lease", "0.5"])
    addr = c.addresses[0]
    with Client([addr], local=LocalPath.OFF) as cl:
        base = ram_used(cl, addr)
        p = subprocess.Popen([sys.executable, "-c", CLIENT_SCRIPT, addr], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert int(p.stdout.readline()) > 0
            assert ram_used(cl, addr) >= base + 2 * (1 << 20)  # reserved
            if how == "killed":
                p.kill()
                p.wait()
                assert poll(lambda: ram_used(cl, addr) == base, 5), "reserved slots were not reclaimed"
                assert cl.exists(["a", "b"]) == [False, False]
            else:
                # Stalled past its lease, the client might still be copying into its slots: they
                # stay reserved (never handed to another value), and its LCOMMIT still commits.
                p.send_signal(signal.SIGSTOP)
                assert not poll(lambda: ram_used(cl, addr) < base + 2 * (1 << 20), 1.5)  # > 2 leases
                assert cl.exists(["a", "b"]) == [False, False]
                p.send_signal(signal.SIGCONT)
                p.stdin.write("\n")
                p.stdin.flush()
                assert p.wait(timeout=10) == 0 and "committed [0, 0]" in p.stdout.read()
                assert cl.exists(["a", "b"]) == [True, True]
                assert ram_used(cl, addr) == base + 2 * (1 << 20)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


STOPPED_READER_SCRIPT = r"""
import sys, time
from gcache.transport import open_connection
from gcache import protocol as P
conn = open_connection("n", sys.argv[1], 2.0, None, local=True)
r = conn.call(P.Op.LGET, {"ns": "default", "keys": [b"k"]}, time.monotonic() + 2)
print(r["ls"], r["off"][0], flush=True)
sys.stdin.readline()
"""


def test_a_stopped_reader_whose_lease_expired_can_be_shed_at_the_connection_cap(make_cluster):
    """A local reader stopped (SIGSTOP) between LGET and LDONE holds a read lease; once the
    reaper released it, the connection holds nothing and is shed like any idle one when the
    cap is reached. Before, ConnState.holding stayed set after the lease expired (only a
    request reset it), so the stopped client's connection could never be shed and every
    newcomer was answered BUSY for as long as it stayed stopped."""
    c = make_cluster(nodes=1, mem="16MiB", extra_args=["--lease", "0.3", "--max-connections", "1"])
    addr = c.addresses[0]
    with Client([addr], local=LocalPath.OFF, timeout_s=5.0) as cl:
        assert cl.put_one("k", b"r" * 300_000) is Status.OK
    p = subprocess.Popen([sys.executable, "-c", STOPPED_READER_SCRIPT, addr], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lease, off = map(int, p.stdout.readline().split())
        assert lease > 0 and off >= 0, "the value was not leased from the arena"
        sigstop(p.pid)

        def expired():
            with open(c.daemons[0].log_path, errors="replace") as f:
                return "expired; read pins released" in f.read()

        assert poll(expired, 5), "the stopped reader's lease never ran out"
        # at the cap (1 connection, the stopped reader's): the newcomer takes its place
        with Client([addr], local=LocalPath.OFF, timeout_s=5.0, connect_timeout_s=5.0) as other:
            assert other.get_one("k") == b"r" * 300_000
            assert addr in other.stats()
    finally:
        os.kill(p.pid, signal.SIGCONT)
        p.kill()
        p.wait()


def test_local_socket_is_not_on_the_filesystem_and_requires_the_token(tmp_path):
    from gcache.cluster import LocalCluster

    with LocalCluster(nodes=1, mem="16MiB", masters=1, root=str(tmp_path / "c")) as c:
        addr = c.addresses[0]
        s = socket.socket(socket.AF_UNIX)
        s.connect(unix_name(addr))  # abstract namespace: nothing to clean up on disk
        s.close()
        with Client(c.master_url, token=c.token, local=LocalPath.FORCE) as cl:
            assert cl.put_one("k", b"v") is Status.OK and cl.get_one("k") == b"v"
        conn = raw_local(addr)  # no HELLO
        with pytest.raises(Exception) as err:
            conn.call(P.Op.LGET, {"ns": "default", "keys": [b"k"]}, time.monotonic() + 2)
        assert "token" in str(err.value) or "authentication" in str(err.value)


READER_SCRIPT = r"""
import ctypes, mmap, os, sys, time
import numpy as np
from gcache.transport import open_connection
addr, off = sys.argv[1], int(sys.argv[2])
conn = open_connection("n", addr, 2.0, None, local=True)
meta, fd = conn.map_arena(time.monotonic() + 2)  # what a reader is handed
print("mode", oct(os.fstat(fd).st_mode & 0o777), flush=True)  # not 0777: other users cannot reopen it rw
try:
    mmap.mmap(fd, meta["size"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    print("mapped writable", flush=True)
except PermissionError:
    print("cannot map writable", flush=True)
mm = mmap.mmap(fd, meta["size"], mmap.MAP_SHARED, mmap.PROT_READ)
print("reads", bytes(mm[off:off + 5]).decode(), flush=True)
ctypes.memset(np.frombuffer(mm, np.uint8).ctypes.data + off, ord("X"), 5)  # a stray write
print("wrote", flush=True)
"""


def test_a_readers_arena_mapping_is_read_only(make_cluster):
    """README: the cluster token is the only boundary; what the local path adds is that a
    reader is handed a read-only descriptor, so a stray write through its mapping faults."""
    c = make_cluster(nodes=1, mem="16MiB")
    addr = c.addresses[0]
    with Client([addr], local=LocalPath.FORCE) as cl:
        assert cl.put_one("k", b"hello" * 1000) is Status.OK
        off = raw_local(addr).call(P.Op.LGET, {"ns": "default", "keys": [b"k"]}, time.monotonic() + 2)["off"][0]
        p = subprocess.run([sys.executable, "-c", READER_SCRIPT, addr, str(off)], capture_output=True,
                           text=True, timeout=60, check=False)
        assert "cannot map writable" in p.stdout and "reads hello" in p.stdout, p.stdout + p.stderr
        assert "mode 0o600" in p.stdout
        assert p.returncode == -signal.SIGSEGV and "wrote" not in p.stdout, (p.returncode, p.stdout, p.stderr)
        assert cl.get_one("k") == b"hello" * 1000
    with Client([addr], local=LocalPath.FORCE, local_min_bytes=0) as reader:  # one that only reads maps read-only
        assert reader.get_one("k") == b"hello" * 1000
        assert [v[2].readonly for v in reader._pool._arenas.values()] == [True]
        assert not reader._pool._rw_arenas
        assert reader.put_one("k2", b"w" * 100) is Status.OK  # its first put maps writable
        assert [v[2].readonly for v in reader._pool._rw_arenas.values()] == [False]
        assert reader.get_one("k2") == b"w" * 100


def test_small_requests_go_inline_over_the_unix_socket_large_ones_through_the_arena(make_cluster):
    c = make_cluster(nodes=1, mem="16MiB")
    addr = c.addresses[0]
    with Client([addr], local=LocalPath.FORCE, local_min_bytes=32 << 10) as cl:
        small = [b"s" * 4096] * 4  # 16 KiB in one request: values carried over the socket
        assert cl.put(["a", "b", "c", "d"], small) == [Status.OK] * 4
        assert not cl._pool._rw_arenas  # no slot was reserved and copied into
        out = [bytearray(4096) for _ in range(4)]
        assert cl.get_into(["a", "b", "c", "d"], out).hits == 4 and out == small
        assert cl.put(["big"], [b"B" * (128 << 10)]) == [Status.OK]  # above the threshold: LALLOC
        assert [v[2].readonly for v in cl._pool._rw_arenas.values()] == [False]
        assert cl.get_one("big") == b"B" * (128 << 10)
