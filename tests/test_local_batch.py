"""Batches over the local shared-memory path when one owner stalls, dies, or races another
client: the batch's arena copies run once every owner has answered (gcache.client.fanout
_finish_local), so these check that an owner that answered in time keeps its keys, no value is
ever returned torn, stale or another key's, and no slot stays pinned or reserved."""

import itertools
import os
import signal
import threading
import time

import numpy as np
import pytest
import xxhash

from gcache import Client, LocalPath, OnNodeError, Status
from gcache.client import fanout
from tests.conftest import poll, sigstop

KiB = 1 << 10


def ram_used(addr):
    """The daemon's ram_used, asked over TCP by a client that knows only this daemon (so a
    stopped one elsewhere cannot hold the question up)."""
    with Client([addr], local=LocalPath.OFF, timeout_s=5.0, connect_timeout_s=5.0) as cl:
        return cl.stats()[addr]["ram_used"]


def keys_of(cl, addr, n, prefix):
    """``n`` keys that ``addr`` owns on ``cl``'s ring."""
    out, i = [], 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if cl.owners([k])[0] == addr:
            out.append(k)
        i += 1
    return out


def local_client(c, **kw):
    kw.setdefault("local_min_bytes", 0)
    kw.setdefault("connect_timeout_s", 5.0)  # a loaded machine accepts slowly
    return Client(c.addresses, local=LocalPath.FORCE, **kw)


def warm(cl, keys):
    """Put and read ``keys`` once so ``cl`` holds an idle connection (its arena mapped read-only
    and writable) to each owner: a stopped daemon then stalls the batch rather than its connect."""
    assert cl.put(keys, [b"w" * (64 * KiB)] * len(keys)) == [Status.OK] * len(keys)
    assert all(v is not None for v in cl.get(keys))
    assert cl.delete(keys) == [True] * len(keys)


@pytest.fixture
def two_with_short_leases(make_cluster):
    """Two daemons whose leases (0.3 s) are shorter than the clients' batch timeouts below."""
    return make_cluster(nodes=2, mem="16MiB", extra_args=["--lease", "0.3"])


def test_a_stalled_owner_does_not_turn_another_owners_gets_into_misses(two_with_short_leases):
    """Owner B is stopped; owner A answered its LGET at once. A's keys must come back as hits,
    byte-exact: a stalled node costs only its own keys. (Since 714dc6c A's copy waits for the
    batch deadline, after A's lease ran out, and A's keys come back as misses.)"""
    c = two_with_short_leases
    a, b = c.addresses
    with local_client(c, timeout_s=1.5, on_node_error=OnNodeError.MISS) as cl:
        ka, kb = keys_of(cl, a, 4, "a"), keys_of(cl, b, 4, "b")
        warm(cl, ka + kb)
        vals = [os.urandom(256 * KiB) for _ in ka + kb]
        assert cl.put(ka + kb, vals) == [Status.OK] * 8
        settled = ram_used(a)
        sigstop(c.daemons[1].pid)
        try:
            out = [np.zeros(256 * KiB, np.uint8) for _ in vals]
            t0 = time.monotonic()
            res = cl.get_into(ka + kb, out)
            assert time.monotonic() - t0 < 1.5 + 1.0
            assert res.status[4:] == [Status.UNAVAILABLE] * 4
            assert res.status[:4] == [Status.OK] * 4, res.status
            assert all(o.tobytes() == v for o, v in zip(out[:4], vals[:4]))
        finally:
            os.kill(c.daemons[1].pid, signal.SIGCONT)
        assert poll(lambda: ram_used(a) == settled, 5)
        assert [bytes(v) for v in cl.get(ka + kb)] == vals


def test_a_stalled_owner_never_makes_a_put_write_into_another_keys_slot(two_with_short_leases):
    """Owner B is stopped during a put to A and B. A reserved slots (LALLOC) at once, under a
    0.3 s lease; when the lease ran out its reaper gave the slots back, and another client's
    values of the same size were stored in them. The stalled put must not then copy its values
    into those slots: the other client's keys must read back as what it wrote."""
    c = two_with_short_leases
    a, b = c.addresses
    size = 256 * KiB
    with local_client(c, timeout_s=6.0, on_node_error=OnNodeError.MISS) as cl, \
            Client([a], local=LocalPath.OFF, timeout_s=5.0) as other:
        ka, kb = keys_of(cl, a, 4, "a"), keys_of(cl, b, 4, "b")
        kw = keys_of(cl, a, 4, "other")
        warm(cl, ka + kb + kw)
        settled = ram_used(a)
        mine = [b"P" * size for _ in ka + kb]
        theirs = [bytes([0x30 + i]) * size for i in range(4)]
        result: list = []
        sigstop(c.daemons[1].pid)
        try:
            t = threading.Thread(target=lambda: result.append(cl.put(ka + kb, mine)))
            t0 = time.monotonic()
            t.start()
            assert poll(lambda: ram_used(a) >= settled + 4 * size, 5), "A never reserved the put's slots"
            # a put that copies and commits on A's reply holds the slots; one that waits for B lets
            # A's lease run out (0.3 s) and the reaper give them back: then they are reused here
            poll(lambda: ram_used(a) == settled, 1.5)
            assert other.put(kw, theirs) == [Status.OK] * 4
            assert time.monotonic() - t0 < 5.0, "too slow to test: the stalled put's deadline may have passed"
            t.join(15)
            assert not t.is_alive()
        finally:
            os.kill(c.daemons[1].pid, signal.SIGCONT)
        got = other.get(kw)
        assert [bytes(g) if g is not None else None for g in got] == theirs, \
            "another key's value was overwritten by the stalled put"
        assert result[0][4:] == [Status.UNAVAILABLE] * 4
        assert result[0][:4] == [Status.OK] * 4, "A answered in time: its keys should be stored"
        assert [bytes(g) for g in other.get(ka)] == mine[:4]
        stored = 4 + result[0][:4].count(Status.OK)
        assert poll(lambda: ram_used(a) == settled + stored * size, 5)  # nothing reserved or pinned


def test_an_owner_killed_between_lalloc_and_lcommit_costs_only_its_own_keys(make_cluster, monkeypatch):
    """A put over three local owners; B is killed after every owner reserved its slots
    (LALLOC answered) and before the copies and LCOMMITs. A's and C's keys are stored byte-exact,
    B's are UNAVAILABLE, and A and C hold exactly the committed values: no slot stays reserved."""
    c = make_cluster(nodes=3, mem="16MiB")
    a, b, cc = c.addresses
    size = 200 * KiB
    real_copy = fanout.copy_all
    with local_client(c, timeout_s=5.0, on_node_error=OnNodeError.MISS) as cl:
        ka, kb, kc = keys_of(cl, a, 3, "a"), keys_of(cl, b, 3, "b"), keys_of(cl, cc, 3, "c")
        keys = ka + kb + kc
        warm(cl, keys)
        settled = {n: ram_used(n) for n in (a, cc)}
        vals = [os.urandom(size) for _ in keys]

        def kill_then_copy(pairs):
            assert poll(lambda: ram_used(a) == settled[a] + 3 * size, 5)  # reserved, not yet committed
            c.kill(1)
            real_copy(pairs)

        monkeypatch.setattr(fanout, "copy_all", kill_then_copy)
        st = cl.put(keys, vals)
        monkeypatch.setattr(fanout, "copy_all", real_copy)
        assert st == [Status.OK] * 3 + [Status.UNAVAILABLE] * 3 + [Status.OK] * 3
        got = cl.get(keys)
        assert [bytes(g) for g in got[:3] + got[6:]] == vals[:3] + vals[6:]
        assert got[3:6] == [None] * 3
        assert {n: ram_used(n) for n in (a, cc)} == {n: settled[n] + 3 * size for n in (a, cc)}
        assert cl.delete(ka + kc) == [True] * 6
        assert {n: ram_used(n) for n in (a, cc)} == settled


@pytest.mark.parametrize("local_min_bytes", [0, 1 << 30])  # every request leased / every one inline
def test_a_scatter_destination_with_an_empty_part_is_filled_whole(make_cluster, local_min_bytes):
    """A value read into [100 B, 0 B, 100 B] fills both non-empty parts on every path (TCP fills
    views past an empty one; the arena copy must too, or the tail keeps stale bytes under OK)."""
    c = make_cluster(nodes=1, mem="16MiB")
    val = os.urandom(150)
    with local_client(c, local_min_bytes=local_min_bytes) as cl, \
            Client(c.addresses, local=LocalPath.OFF) as tcp:
        assert cl.put(["k"], [val]) == [Status.OK]
        for client in (cl, tcp):
            a, empty, b = bytearray(100), bytearray(0), bytearray(b"\xee" * 100)
            res = client.get_into(["k"], [[a, empty, b]])
            assert res.status == [Status.OK] and res.sizes == [150]
            assert bytes(a) + bytes(b[:50]) == val and bytes(b[50:]) == b"\xee" * 50
        # and a value written from parts, some empty
        assert cl.put(["p"], [[b"", b"abc", bytearray(0), memoryview(b"de"), b""]]) == [Status.OK]
        assert tcp.get_one("p") == b"abcde" and cl.get_one("p") == b"abcde"


def random_dest(rng, size):
    """A destination for a value of ``size`` bytes and what fits: exact, with slack, too small
    (when size > 0), or a scatter list of 1..3 parts (some may be empty)."""
    kind = int(rng.integers(0, 4)) if size else int(rng.integers(0, 2))
    if kind == 0:
        return bytearray(b"\xee" * size)
    if kind == 1:
        return bytearray(b"\xee" * (size + int(rng.integers(1, 100))))
    if kind == 2:
        return bytearray(b"\xee" * int(rng.integers(0, size)))
    cuts = sorted(int(x) for x in rng.integers(0, size + 1, int(rng.integers(0, 3))))
    bounds = [0, *cuts, size + int(rng.integers(0, 2)) * 7]
    return [bytearray(b"\xee" * (hi - lo)) for lo, hi in itertools.pairwise(bounds)]


def check_get(keys, dests, res, truth):
    for k, d, st, sz in zip(keys, dests, res.status, res.sizes):
        v = truth.get(k)
        cap = sum(map(len, d)) if isinstance(d, list) else len(d)
        if v is None:
            assert st is Status.NOT_FOUND, (k, st)
            continue
        assert sz == len(v), (k, sz, len(v))
        if cap < len(v):
            assert st is Status.BUFFER_TOO_SMALL, (k, st)
            continue
        assert st is Status.OK, (k, st)
        flat = b"".join(map(bytes, d)) if isinstance(d, list) else bytes(d)
        assert flat[:len(v)] == v and flat[len(v):] == b"\xee" * (cap - len(v)), k


@pytest.mark.parametrize("seed", range(3))
def test_a_batch_mixing_inline_and_leased_requests_is_byte_exact(make_cluster, monkeypatch, seed):
    """Random batches over two local owners, split into small requests (some carried inline over
    the Unix socket, some copied through the arena, by their bytes), with misses, empty values,
    exact, roomy, too small and scatter destinations (some parts empty), and a key asked twice:
    every status and size is what TCP answers, and every hit is byte-exact, slack untouched."""
    c = make_cluster(nodes=2, mem="32MiB")
    rng = np.random.default_rng(seed)
    sizes = [0, 1, 100, 4 * KiB, 70 * KiB, 300 * KiB]
    truth = {f"k{i}": os.urandom(sizes[int(rng.integers(len(sizes)))]) for i in range(48)}
    keys = [*truth, *(f"absent{i}" for i in range(8))]
    real_copy, copied = fanout.copy_all, [0]

    def counting_copy(pairs):
        copied[0] += len(pairs)
        real_copy(pairs)

    monkeypatch.setattr(fanout, "copy_all", counting_copy)
    with local_client(c, local_min_bytes=64 * KiB, split_keys=3) as cl, \
            Client(c.addresses, local=LocalPath.OFF) as tcp:
        assert len(set(cl.owners(keys))) == 2
        base = {a: ram_used(a) for a in c.addresses}
        stored = list(truth)
        st = cl.put(stored, [truth[k] for k in stored])
        assert st == [Status.OK] * len(stored)
        settled = {a: ram_used(a) for a in c.addresses}
        for _round in range(4):
            batch = [keys[int(i)] for i in rng.permutation(len(keys))[:24]]
            batch.append(batch[0])  # the same key twice in one batch
            dests = [random_dest(rng, len(truth.get(k, b"")) or int(rng.integers(1, 1000))) for k in batch]
            res = cl.get_into(batch, dests)
            check_get(batch, dests, res, truth)
            dests2 = [[bytearray(len(p)) for p in d] if isinstance(d, list) else bytearray(len(d)) for d in dests]
            res2 = tcp.get_into(batch, dests2)
            assert res.status == res2.status and res.sizes == res2.sizes
            got = cl.get(batch)
            assert [None if g is None else bytes(g) for g in got] == [truth.get(k) for k in batch]
        assert copied[0] > 0  # some requests went through the arena
        assert {a: ram_used(a) for a in c.addresses} == settled
        assert cl.delete(stored) == [True] * len(stored)
        assert poll(lambda: {a: ram_used(a) for a in c.addresses} == base, 5)  # nothing left pinned


def stamped(key, version, size):
    """A value that says which key and version it is, with a hash of all of it."""
    body = os.urandom(size)
    head = xxhash.xxh3_64_digest(key.encode()) + version.to_bytes(8, "little")
    return head + xxhash.xxh3_64_digest(head + body) + body


def unstamp(value):
    """(key hash, version) of a stamped value, or None if it is torn."""
    head, digest, body = value[:16], value[16:24], value[24:]
    if xxhash.xxh3_64_digest(head + body) != digest:
        return None
    return head[:8], int.from_bytes(head[8:], "little")


def test_gets_racing_overwrites_and_deletes_return_only_values_written_for_that_key(make_cluster):
    """Readers over the local path race a writer that overwrites keys (small arenas: slots are
    evicted and reused) and deletes others for good. Every hit is a whole value written for that
    very key, and a key whose delete was acknowledged before a get started never comes back."""
    c = make_cluster(nodes=2, mem="4MiB", extra_args=["--lease", "0.5"])
    live = [f"live{i}" for i in range(24)]
    size = 96 * KiB
    written: dict[str, set[int]] = {k: set() for k in live}
    deleted_at: dict[str, float] = {}  # retired key -> when its delete was acknowledged
    stop = threading.Event()
    bad: list = []
    counts = {"hits": 0, "writes": 0, "retired": 0}

    def writer():
        rng = np.random.default_rng(1)
        version = 0
        with local_client(c, timeout_s=5.0) as cl:
            while not stop.is_set():
                version += 1
                if version % 8 == 0:  # a key written twice, then deleted for good
                    k = f"gone{version}"
                    written[k] = {version, version + 1}
                    cl.put([k], [stamped(k, version, size)])
                    cl.put([k], [stamped(k, version + 1, size)])
                    assert cl.delete([k]) in ([True], [False])  # False: already evicted
                    deleted_at[k] = time.monotonic()
                    counts["retired"] += 1
                    continue
                ks = [live[int(i)] for i in rng.choice(len(live), 3, replace=False)]
                for k in ks:
                    written[k].add(version)
                cl.put(ks, [stamped(k, version, size + int(rng.integers(0, 3)) * 8 * KiB) for k in ks])
                counts["writes"] += 3

    def reader(seed):
        rng = np.random.default_rng(seed)
        out = [bytearray(size + 24 * KiB) for _ in range(6)]
        with local_client(c, timeout_s=5.0) as cl:
            while not stop.is_set():
                gone = [k for k in list(deleted_at) if rng.random() < 0.3][:2]
                ks = [live[int(i)] for i in rng.choice(len(live), 6 - len(gone), replace=False)] + gone
                started = time.monotonic()
                res = cl.get_into(ks, out)
                for k, st, sz, o in zip(ks, res.status, res.sizes, out):
                    if st is not Status.OK:
                        continue
                    counts["hits"] += 1
                    got = unstamp(bytes(o[:sz]))
                    if got is None:
                        bad.append((k, "torn"))
                    elif got[0] != xxhash.xxh3_64_digest(k.encode()):
                        bad.append((k, "another key's value"))
                    elif got[1] not in written[k]:
                        bad.append((k, f"version {got[1]} never written"))
                    elif k in deleted_at and deleted_at[k] < started:
                        bad.append((k, "came back after its delete"))

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in (2, 3)]
    for t in threads:
        t.start()
    try:
        poll(lambda: bad or (counts["hits"] > 300 and counts["writes"] > 300 and counts["retired"] > 20), 12)
    finally:
        stop.set()
        for t in threads:
            t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert not bad, bad[:5]
    assert counts["hits"] > 300 and counts["writes"] > 300 and counts["retired"] > 20, counts
    with local_client(c) as cl:
        assert not any(cl.exists(list(deleted_at)))


@pytest.mark.parametrize("nodes", [1, 3])
def test_exists_and_delete_of_thousands_of_keys_in_one_call(make_cluster, nodes):
    """EXISTS and DELETE go one request per owner up to 4096 keys (PROBE_SPLIT_KEYS). A call
    of 5000 keys (some of the longest allowed, 1024 B) with empty and over-long ones mixed in:
    each key answered for itself, the wrong ones BAD_KEY, exactly the stored ones deleted."""
    c = make_cluster(nodes=nodes, mem="64MiB")
    keys = [f"k{i}".encode() if i % 5 else f"k{i}".encode().ljust(1024, b"L") for i in range(5000)]
    stored = set(keys[::3])
    wrong = {7: b"", 2500: b"x" * 1025, 4999: b"y" * 4000}
    batch = list(keys)
    for i, k in wrong.items():
        batch[i] = k
    with Client(c.addresses, timeout_s=10.0) as cl:
        put = [k for k in stored if k not in wrong.values()]
        for i in range(0, len(put), 500):
            assert cl.put(put[i:i + 500], [b"v"] * len(put[i:i + 500])) == [Status.OK] * len(put[i:i + 500])
        want = [k in stored and i not in wrong for i, k in enumerate(batch)]
        assert cl.exists(batch) == want
        st = cl.delete_status(batch)
        assert [i for i, s in enumerate(st) if s is Status.BAD_KEY] == sorted(wrong)
        assert [s is Status.OK for s in st] == want
        assert not any(cl.exists(batch))
        assert sum(s["ram_keys"] for s in cl.stats().values()) == 0


def test_a_key_too_long_to_decode_costs_only_itself(make_cluster):
    """A key over the metadata's string limit (64 KiB) in a call of 3000 keys: the daemon cannot
    decode the request and refuses all of it. Since keys-only requests are no longer split at 64
    keys, every other key of that owner (up to 4096) goes UNAVAILABLE with it; it should be
    BAD_KEY alone (the client can tell: gcache.protocol.key_error)."""
    c = make_cluster(nodes=1, mem="16MiB")
    keys = [f"k{i}".encode() for i in range(3000)]
    with Client(c.addresses, on_node_error=OnNodeError.MISS) as cl:
        assert cl.put(keys[:100], [b"v"] * 100) == [Status.OK] * 100
        st = cl.delete_status([*keys[:1500], b"z" * 70_000, *keys[1500:]])
        assert st[1500] is Status.BAD_KEY
        assert st[:100] == [Status.OK] * 100 and st[100:1500] == [Status.NOT_FOUND] * 1400
        assert st[1501:] == [Status.NOT_FOUND] * 1500


def test_a_stopped_owner_costs_only_its_keys_and_leaks_nothing_after_it_resumes(make_cluster):
    """Three local owners, leases (5 s) longer than the batch timeout (1 s); B is stopped while
    gets and puts run: A's and C's keys are read and written byte-exact within the timeout, B's
    are UNAVAILABLE; once B resumes, every daemon's ram_used settles where the values say."""
    c = make_cluster(nodes=3, mem="32MiB")
    a, b, cc = c.addresses
    size = 300 * KiB
    # the put reconnects to B (the get's timeout closed that connection): connect_timeout_s
    # bounds that connect, so it is kept under the batch timeout here
    with local_client(c, timeout_s=1.0, connect_timeout_s=0.75, on_node_error=OnNodeError.MISS) as cl:
        ka, kb, kc = keys_of(cl, a, 4, "a"), keys_of(cl, b, 4, "b"), keys_of(cl, cc, 4, "c")
        keys = ka + kb + kc
        warm(cl, keys)
        old = [os.urandom(size) for _ in keys]
        assert cl.put(keys, old) == [Status.OK] * 12
        settled = {n: ram_used(n) for n in c.addresses}
        new = [os.urandom(size) for _ in keys]
        sigstop(c.daemons[1].pid)
        try:
            t0 = time.monotonic()
            out = [np.zeros(size, np.uint8) for _ in keys]
            res = cl.get_into(keys, out)
            t1 = time.monotonic()
            st = cl.put(keys, new)
            t2 = time.monotonic()
        finally:
            os.kill(c.daemons[1].pid, signal.SIGCONT)
        assert t1 - t0 < 1.0 + 0.75 and t2 - t1 < 1.0 + 0.75, (t1 - t0, t2 - t1)  # slack for a loaded machine
        assert res.status == [Status.OK] * 4 + [Status.UNAVAILABLE] * 4 + [Status.OK] * 4
        assert [o.tobytes() for o in out[:4] + out[8:]] == old[:4] + old[8:]
        assert st == [Status.OK] * 4 + [Status.UNAVAILABLE] * 4 + [Status.OK] * 4
        assert poll(lambda: {n: ram_used(n) for n in c.addresses} == settled, 10)  # B's pins and slots released
        got = cl.get(keys)
        assert [bytes(g) for g in got] == new[:4] + old[4:8] + new[8:]


def test_one_lget_answering_both_arena_offsets_and_inline_values_fills_every_destination(make_cluster):
    """RAM full of pinned values, the rest on NVMe: one LGET answers arena offsets for the
    pinned keys and sends the others inline (no room to promote them). The inline ones are
    read as the reply comes, the arena ones copied with the batch; exact, too small and scatter
    destinations (with an empty part) get exactly their bytes on both, and nothing stays pinned."""
    from gcache import protocol as P
    from gcache.transport import open_connection

    c = make_cluster(nodes=1, mem="2MiB", disk="64MiB")
    addr = c.addresses[0]
    keys = [f"k{i}" for i in range(24)]
    vals = {k: os.urandom(256 * KiB) for k in keys}  # 6 MiB over 2 MiB of RAM
    with local_client(c, on_node_error=OnNodeError.MISS) as cl:
        for k in keys:
            assert cl.put([k], [vals[k]]) == [Status.OK]
        assert poll(lambda: cl.stats()[addr]["demote_queue_bytes"] == 0, 10)
        pin = open_connection("pin", addr, 5.0, None, local=True)
        dl = time.monotonic() + 5
        pin.send(P.Op.LGET, {"ns": "default", "keys": [k.encode() for k in keys]}, [], dl, 5.0)
        reply, plen = pin.recv_reply(dl)
        pin.discard(plen, dl)
        in_ram = [k for k, off in zip(keys, reply["off"]) if off >= 0]
        on_disk = [k for k, off in zip(keys, reply["off"]) if off < 0]
        assert len(in_ram) >= 4 and len(on_disk) >= 4, reply["off"]
        batch = [in_ram[0], on_disk[0], in_ram[1], on_disk[1], in_ram[2], on_disk[2], on_disk[3], in_ram[3]]
        size = 256 * KiB
        dests = [bytearray(size), bytearray(size + 5), bytearray(100), bytearray(10),
                 [bytearray(1000), bytearray(0), bytearray(size)], [bytearray(0), bytearray(size - 1), bytearray(1)],
                 bytearray(size), [bytearray(size // 2), bytearray(size // 2)]]
        res = cl.get_into(batch, dests)
        assert res.status == [Status.OK, Status.OK, Status.BUFFER_TOO_SMALL, Status.BUFFER_TOO_SMALL,
                              Status.OK, Status.OK, Status.OK, Status.OK], res.status
        assert res.sizes == [size] * 8
        for k, d, st in zip(batch, dests, res.status):
            if st is Status.OK:
                flat = b"".join(map(bytes, d)) if isinstance(d, list) else bytes(d)
                assert flat[:size] == vals[k] and flat[size:] == bytes(len(flat) - size), k
        assert [bytes(g) for g in cl.get(batch)] == [vals[k] for k in batch]  # the connection stayed in sync
        done = pin.call(P.Op.LDONE, {"ls": [reply["ls"]]}, time.monotonic() + 5)
        assert done["ok"] == [True]
        pin.close()
        assert cl.delete(keys) == [True] * len(keys)
        assert poll(lambda: cl.stats()[addr]["ram_used"] == 0, 5)  # no pin left behind


def test_one_client_shared_by_threads_moving_large_batches_stays_byte_exact(make_cluster):
    """One client used by three reader threads and a writer at once, batches of 8 MiB and 4 MiB
    (their copies split over the process's one copy helper thread, which every caller shares):
    every hit is a whole value written for that key."""
    c = make_cluster(nodes=2, mem="64MiB")
    keys = [f"big{i}" for i in range(16)]
    size = 1 << 20
    written: dict[str, set[int]] = {k: {0} for k in keys}
    stop = threading.Event()
    bad: list = []
    counts = {"hits": 0, "writes": 0}
    with local_client(c, timeout_s=10.0) as cl:
        assert cl.put(keys, [stamped(k, 0, size) for k in keys]) == [Status.OK] * 16

        def writer():
            rng = np.random.default_rng(5)
            version = 0
            while not stop.is_set():
                version += 1
                ks = [keys[int(i)] for i in rng.choice(len(keys), 4, replace=False)]
                for k in ks:
                    written[k].add(version)
                if cl.put(ks, [stamped(k, version, size) for k in ks]) != [Status.OK] * 4:
                    bad.append(("put", version))
                counts["writes"] += 4

        def reader(seed):
            rng = np.random.default_rng(seed)
            out = [np.empty(size + 24, np.uint8) for _ in range(8)]
            while not stop.is_set():
                ks = [keys[int(i)] for i in rng.choice(len(keys), 8, replace=False)]
                res = cl.get_into(ks, out)
                for k, st, sz, o in zip(ks, res.status, res.sizes, out):
                    if st is not Status.OK:
                        bad.append((k, st))  # nothing is evicted or deleted here: every get hits
                        continue
                    counts["hits"] += 1
                    got = unstamp(o[:sz].tobytes())
                    if got is None or got[0] != xxhash.xxh3_64_digest(k.encode()) or got[1] not in written[k]:
                        bad.append((k, got))

        threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            poll(lambda: bad or (counts["hits"] > 200 and counts["writes"] > 60), 12)
        finally:
            stop.set()
            for t in threads:
                t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert not bad, bad[:5]
        assert counts["hits"] > 200 and counts["writes"] > 60, counts


def test_an_owner_killed_between_lget_and_ldone_costs_at_most_its_own_keys(make_cluster, monkeypatch):
    """A get over three local owners; B is killed after every LGET was answered, before the
    copies and LDONEs. A's and C's keys are hits, byte-exact, and released (deleting them brings
    ram_used back to where it was); B's are UNAVAILABLE or, if reported, byte-exact."""
    c = make_cluster(nodes=3, mem="16MiB")
    a, b, cc = c.addresses
    size = 200 * KiB
    real_copy = fanout.copy_all
    with local_client(c, timeout_s=5.0, on_node_error=OnNodeError.MISS) as cl:
        ka, kb, kc = keys_of(cl, a, 3, "a"), keys_of(cl, b, 3, "b"), keys_of(cl, cc, 3, "c")
        keys = ka + kb + kc
        warm(cl, keys)
        base = {n: ram_used(n) for n in (a, cc)}
        vals = [os.urandom(size) for _ in keys]
        assert cl.put(keys, vals) == [Status.OK] * 9

        def kill_then_copy(pairs):
            c.kill(1)
            real_copy(pairs)

        monkeypatch.setattr(fanout, "copy_all", kill_then_copy)
        out = [np.zeros(size, np.uint8) for _ in keys]
        res = cl.get_into(keys, out)
        monkeypatch.setattr(fanout, "copy_all", real_copy)
        assert res.status[:3] + res.status[6:] == [Status.OK] * 6
        assert [o.tobytes() for o in out[:3] + out[6:]] == vals[:3] + vals[6:]
        for st, o, v in zip(res.status[3:6], out[3:6], vals[3:6]):
            assert st is Status.UNAVAILABLE or (st is Status.OK and o.tobytes() == v)
        assert cl.delete(ka + kc) == [True] * 6
        assert poll(lambda: {n: ram_used(n) for n in (a, cc)} == base, 5)  # no pin left on A or C
