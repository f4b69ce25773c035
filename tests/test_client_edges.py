"""Client edges found by probes: the same key twice in one batch, a membership in which nothing
owns keys, membership refreshes bounded by the call's deadline, a bootstrap no master answers."""

import signal
import socket
import threading
import time

import pytest

from gcache import Client, LocalPath, OnNodeError, Status
from gcache.cluster import LocalCluster
from gcache.errors import ConfigError
from gcache.meta.master_client import MasterClient, MasterUnavailable
from tests.conftest import poll, sigstop


@pytest.mark.parametrize("local", [LocalPath.OFF, LocalPath.FORCE])
def test_the_same_key_twice_in_one_put_keeps_the_last_value(make_cluster, local):
    """Split into several requests (130 keys: 64 + 64 + 2), the two copies could land in any
    order: the last one in the batch wins, every time (a probe: the inline local path kept the
    first 39 times of 40)."""
    c = make_cluster(nodes=1)
    with Client(c.addresses, local=local, local_min_bytes=1 << 30 if local is LocalPath.FORCE else 0) as cl:
        for trial in range(10):
            keys = ["dup", *(f"o{trial}-{i}" for i in range(128)), "dup"]
            vals = [b"first-%d" % trial, *(b"x" * 100 for _ in range(128)), b"last-%d" % trial]
            assert cl.put(keys, vals) == [Status.OK] * len(keys)
            assert cl.get_one("dup") == b"last-%d" % trial
        assert cl.put(["a", "a"], [b"1", b"2"], ttl_s=[0.0, 60.0], fmt=[1, 2]) == [Status.OK] * 2
        got = cl.get_into(["a"], [bytearray(8)], with_meta=True)
        assert got.sizes == [1] and got.meta[0].fmt == 2


@pytest.fixture
def mastered(tmp_path):
    c = LocalCluster(nodes=1, mem="32MiB", masters=1, root=str(tmp_path / "c"),
                     master_args=["--suspect-after", "0.5", "--down-after", "1.5"],
                     extra_args=["--heartbeat", "0.2", "--fence-after", "0.6"]).start()
    try:
        yield c
    finally:
        for p in [*c.daemons, *c.master_procs]:
            if p.proc is not None and p.proc.poll() is None:
                p.proc.send_signal(signal.SIGCONT)
        c.stop()


def test_a_membership_in_which_nothing_owns_keys_is_adopted_and_every_key_is_unavailable(mastered):
    """Every daemon declared down: a client following the masters routes by that membership
    (nothing owns keys: every key a miss), not on by the one before (before, it refused the
    membership, kept routing to the declared-down daemons and backed off from the masters)."""
    c = mastered
    mc = MasterClient(c.master_url, c.token, timeout_s=2.0)
    with Client(c.master_url, token=c.token, timeout_s=0.5, on_node_error=OnNodeError.MISS) as cl:
        assert cl.put_one("k", b"v") is Status.OK
        c.kill(0, signal.SIGSTOP)
        assert poll(lambda: all(r["state"] == "down" for r in mc.membership()["nodes"]), 10)
        epoch = mc.membership()["epoch"]
        assert poll(lambda cl=cl: cl._view.epoch >= epoch, 5)
        t0 = time.monotonic()
        assert cl.get(["k"]) == [None] and cl.put(["k"], [b"w"]) == [Status.UNAVAILABLE]
        assert time.monotonic() - t0 < 0.5  # nothing to wait for: no owner
        with pytest.raises(LookupError):
            cl.owners(["k"])
        c.daemons[0].proc.send_signal(signal.SIGCONT)  # it rejoins: the client routes again
        assert poll(lambda: cl.put_one("k", b"w") is Status.OK, 10)
        assert cl.get_one("k") == b"w"
    mc.close()


def test_a_membership_refresh_ends_by_the_deadline_it_is_given(mastered):
    """A client cut off from the masters: a refresh a call makes is bounded by the call's
    deadline, not one master timeout per master (a probe: 3 s calls with timeout_s=0.5)."""
    c = mastered
    with Client(c.master_url, token=c.token, timeout_s=0.5, connect_timeout_s=1.0) as cl:
        sigstop(c.master_procs[0].pid)
        t0 = time.monotonic()
        assert cl.refresh_membership(time.monotonic() + 0.3) is False
        assert time.monotonic() - t0 < 0.8


def test_a_silent_first_master_costs_a_bootstrap_a_short_wait_not_its_whole_attempt(mastered, monkeypatch):
    """A master that accepts connections and never answers (a stopped process, a host behind a
    DROP rule) cost every client that tried it first its whole attempt (1 s), one per silent
    master; now the others are asked at once after a short wait, and the watch moves on."""
    c = mastered
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes handshakes; nothing ever answers
        quiet = f"127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setattr(MasterClient, "shuffled", lambda self: sorted(self.addresses, key=lambda a: a != quiet))
        url = f"gcache://{quiet},{c.master_url.removeprefix('gcache://')}"
        for _ in range(3):
            t0 = time.monotonic()
            with Client(url, token=c.token, timeout_s=1.0) as cl:
                took = time.monotonic() - t0
                assert cl.put_one("k", b"v") is Status.OK and cl.get_one("k") == b"v"
                assert cl._watcher is not None
                assert poll(lambda: cl._watcher.address not in (None, quiet), 5)  # the watch moved on
            assert took < 0.8, f"a bootstrap took {took:.2f}s behind a silent master"


def test_a_client_no_master_answers_fails_fast_and_says_why():
    ports = []
    for _ in range(3):  # ports nothing listens on
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        ports.append(s.getsockname()[1])
        s.close()
    t0 = time.monotonic()
    with pytest.raises(MasterUnavailable) as err:  # a ConnectionError (it was a ConfigError)
        Client("gcache://" + ",".join(f"127.0.0.1:{p}" for p in ports), token="t", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.0
    assert isinstance(err.value, ConnectionError)
    assert "no master answered" in str(err.value) and "UNAVAILABLE" in str(err.value)


@pytest.mark.parametrize("bare", ["abc", b"abc"])
def test_a_bare_str_or_bytes_where_keys_are_expected_is_refused_not_split_into_characters(make_cluster, bare):
    """delete("abc") deleted the keys "a", "b" and "c" (a str is a sequence of one-character
    keys); put/get/exists did the same. A batch call now refuses a bare str or bytes with a
    TypeError that says what to pass, and touches nothing."""
    c = make_cluster(nodes=1)
    with Client(c.addresses, local=LocalPath.OFF) as cl:
        assert cl.put(["a", "b", "c"], [b"1", b"2", b"3"]) == [Status.OK] * 3
        calls = {"delete": lambda: cl.delete(bare), "delete_status": lambda: cl.delete_status(bare),
                 "exists": lambda: cl.exists(bare), "get": lambda: cl.get(bare),
                 "get_into": lambda: cl.get_into(bare, [bytearray(1)] * 3),
                 "put": lambda: cl.put(bare, [b"x"] * 3), "owners": lambda: cl.owners(bare)}
        for name, call in calls.items():
            with pytest.raises(TypeError, match="sequence of keys.*bare") as err:
                call()
            assert "get_one" in str(err.value), name
        assert cl.get(["a", "b", "c"]) == [b"1", b"2", b"3"]
        assert cl.get_one("abc") is None and cl.delete(["abc"]) == [False]  # the single-key forms still work


def test_an_empty_namespace_is_refused_not_taken_for_the_clients(make_cluster):
    """namespace="" meant the client's namespace (``namespace or self.namespace``), so
    clear(namespace="") wiped the default namespace. The daemons refuse an empty namespace,
    and so does every call now; None stays "the client's namespace"."""
    c = make_cluster(nodes=1)
    with Client(c.addresses, local=LocalPath.OFF) as cl:
        assert cl.put(["k"], [b"v"]) == [Status.OK]
        calls = {"clear": lambda: cl.clear(namespace=""), "put": lambda: cl.put(["k"], [b"x"], namespace=""),
                 "get": lambda: cl.get(["k"], namespace=""), "exists": lambda: cl.exists(["k"], namespace=""),
                 "delete": lambda: cl.delete(["k"], namespace=""), "owners": lambda: cl.owners(["k"], namespace=""),
                 "get_into": lambda: cl.get_into(["k"], [bytearray(1)], namespace="")}
        for name, call in calls.items():
            with pytest.raises(ValueError, match="namespace must be"):
                call()
            assert cl.get(["k"]) == [b"v"], f"{name}(namespace='') touched the default namespace"
        assert cl.get(["k"], namespace=None) == [b"v"] and cl.get(["k"], namespace="default") == [b"v"]


def test_a_ttl_that_is_not_a_finite_number_of_seconds_is_refused(make_cluster):
    """A NaN TTL passed the ``t < 0`` check and went to the daemons."""
    c = make_cluster(nodes=1)
    with Client(c.addresses, local=LocalPath.OFF) as cl:
        for bad in (float("nan"), float("inf"), -1.0, [1.0, float("nan")]):
            with pytest.raises(ValueError, match="ttl_s must be a finite number"):
                cl.put(["k", "j"], [b"v", b"w"], ttl_s=bad)
        assert cl.exists(["k", "j"]) == [False, False]
        assert cl.put(["k"], [b"v"], ttl_s=30.0) == [Status.OK] and cl.get(["k"]) == [b"v"]


def test_on_failure_hears_each_failed_owner_when_failures_are_misses():
    """With on_node_error=MISS a failed owner's keys are misses and nothing is raised; on_failure
    is how a caller that must not raise (the SGLang embedding store) still learns why."""
    seen = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: connection refused
        with Client([down], local=LocalPath.OFF, on_node_error=OnNodeError.MISS, on_failure=seen.append,
                    timeout_s=2.0) as cl:
            assert cl.get(["k"]) == [None] and cl.exists(["k"]) == [False]
    assert len(seen) == 2 and all(down in str(e) for e in seen), seen


@pytest.mark.parametrize("value", [float("inf"), float("nan"), True, 0, -1.0, 86400.5, 2.2e6])
@pytest.mark.parametrize("name", ["timeout_s", "connect_timeout_s"])
def test_a_timeout_that_is_not_a_finite_number_of_seconds_is_a_clear_config_error(name, value):
    """A probe: ClientConfig(timeout_s=inf) was accepted and then every call raised OverflowError
    from poll() in gcache.net.stream (NaN never ends a wait either); so did 2.2e6 s (poll's
    milliseconds overflow a C int past ~24.8 days): at most a day is accepted."""
    from gcache.client.config import ClientConfig

    with pytest.raises(ConfigError, match=f"{name} must be a finite number of seconds > 0"):
        ClientConfig(**{name: value})
    with pytest.raises(ConfigError, match=name):
        Client(["127.0.0.1:1"], **{name: value})


@pytest.mark.parametrize("nodes", [["127.0.0.1:99999"], ["127.0.0.1:0"], ["127.0.0.1:7400,127.0.0.1:7401"],
                                   ["127.0.0.1:"], ["127.0.0.1:x"]])
def test_a_node_address_that_cannot_be_connected_to_is_refused_up_front(nodes):
    """A probe: port 99999, port 0 and two addresses in one list element were accepted; every
    call then failed (the SGLang adapter ran on with every page a miss)."""
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        Client(nodes)


def test_a_deadline_shorter_than_timeout_s_ends_the_call_and_a_bad_one_is_refused(make_cluster):
    """put/exists take a ``deadline`` (time.monotonic()) so that two calls can share one: the
    call ends by it when it is sooner than timeout_s from now, never later."""
    c = make_cluster(nodes=1)
    with Client(c.addresses, timeout_s=5.0, on_node_error=OnNodeError.MISS) as cl:
        assert cl.put(["k"], [b"v"], deadline=time.monotonic() + 5.0) == [Status.OK]
        assert cl.exists(["k"], deadline=time.monotonic() + 5.0) == [True]
        sigstop(c.daemons[0].pid)
        try:
            t0 = time.monotonic()
            assert cl.exists(["k"], deadline=t0 + 0.3) == [False]
            assert cl.put(["k2"], [b"v"], deadline=t0 + 0.6) == [Status.UNAVAILABLE]
            assert time.monotonic() - t0 < 1.5
        finally:
            c.daemons[0].proc.send_signal(signal.SIGCONT)
        for bad in (float("nan"), float("inf"), "soon", True):
            with pytest.raises(ValueError, match="deadline"):
                cl.exists(["k"], deadline=bad)
            with pytest.raises(ValueError, match="deadline"):
                cl.put(["k"], [b"v"], deadline=bad)


@pytest.mark.parametrize("local", [LocalPath.OFF, LocalPath.FORCE])
def test_a_client_used_after_a_fork_raises_and_the_parent_is_unaffected(make_cluster, local):
    """A forked child shares the parent client's pooled connections: both could send the same
    request id on one socket and take each other's reply (a probe: get() returned the other
    process's value as a hit, on TCP and on the local path). In the child every call raises
    ClientForked, whatever on_node_error says; closing the inherited client there leaves the
    parent's connections alone; a new Client in the child works."""
    import os

    from gcache import ClientForked

    c = make_cluster(nodes=2)
    with Client(c.addresses, local=local, on_node_error=OnNodeError.MISS, timeout_s=5.0) as cl:
        keys = [f"k{i}" for i in range(20)]
        assert cl.put(keys, [k.encode() for k in keys]) == [Status.OK] * len(keys)
        assert [bytes(v) for v in cl.get(keys)] == [k.encode() for k in keys]  # idle connections pooled
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report by exit status only
            code = 0
            try:
                for call in (lambda: cl.get(keys), lambda: cl.put(["x"], [b"x"]), lambda: cl.exists(keys),
                             lambda: cl.stats()):
                    try:
                        call()
                        code = 1
                    except ClientForked:
                        pass
                cl.close()
                with Client(c.addresses, local=local, timeout_s=5.0) as mine:
                    if [bytes(v) for v in mine.get(keys)] != [k.encode() for k in keys]:
                        code = 2
            except BaseException:  # noqa: BLE001 - any surprise fails the test
                code = 3
            os.write(w, b"done")
            os._exit(code)
        os.close(w)
        assert os.read(r, 4) == b"done"
        os.close(r)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        for _ in range(3):  # the parent's pooled connections survived the child's close
            assert [bytes(v) for v in cl.get(keys)] == [k.encode() for k in keys]


def test_a_closed_client_refuses_calls_and_keeps_no_connection(make_cluster):
    """A probe: calls after close() worked silently (opening new connections), and calls running
    during close() put their connections back into the closed client's pool."""
    from gcache import ClientClosed

    c = make_cluster(nodes=1)
    cl = Client(c.addresses, timeout_s=5.0)
    assert cl.put(["k"], [b"v"]) == [Status.OK]
    conn = cl._pool.get(c.daemons[0].node_id, c.addresses[0])  # a call running across the close
    cl.close()
    cl._pool.put(conn)  # ...ends: its connection is closed, not pooled
    assert conn.broken and not any(cl._pool._idle.values())
    for call in (lambda: cl.get(["k"]), lambda: cl.put(["k"], [b"w"]), lambda: cl.exists(["k"]), cl.stats):
        with pytest.raises(ClientClosed):
            call()
    cl.close()  # twice is fine


def test_a_stalled_daemon_does_not_make_the_others_look_failed(make_cluster):
    """stats() and clear() read the daemons' replies one after another against one deadline: a
    stalled daemon first in line ran it out, and every daemon after it was reported failed
    though it had answered (and clear() said those keep their keys, having deleted them)."""
    import os

    c = make_cluster(nodes=3)
    with Client(c.addresses, timeout_s=1.0, on_node_error=OnNodeError.MISS) as cl:
        keys = [f"k{i}" for i in range(60)]
        assert cl.put(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
        first = next(iter(cl._view.addr))
        stalled = next(d for d in c.daemons if first in (d.node_id, d.address))
        sigstop(stalled.pid)
        try:
            stats = cl.stats()
            assert set(stats) == set(cl._view.addr)
            assert "error" in stats[first]
            answered = [n for n in stats if n != first]
            assert all("ram_used" in stats[n] for n in answered), stats
            result = cl.clear(namespace="default")
            assert set(result.failed) == {first} and set(result.deleted) == set(answered)
        finally:
            os.kill(stalled.pid, signal.SIGCONT)


@pytest.mark.parametrize("local", [LocalPath.OFF, LocalPath.FORCE])
def test_a_batch_of_many_requests_opens_a_few_connections_per_owner(make_cluster, local, monkeypatch):
    """A local-path put of 100,000 small keys is split 64 keys a request (~1,500 requests): each
    owner without an idle connection got one new connection and one thread per request (a probe:
    738 threads, connects timing out although timeout_s was 60, 10% of the keys not written).
    Now a few connections per owner carry the requests in turn; every key is written."""
    from gcache.client import fanout, pool

    c = make_cluster(nodes=2)
    opened = []
    real = pool.open_connection
    monkeypatch.setattr(pool, "open_connection", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    keys = [f"k{i}" for i in range(20_000)]
    with Client(c.addresses, local=local, local_min_bytes=0, timeout_s=30.0) as cl:
        # get without buffers: sizes unknown, so split by key count over TCP too
        assert cl.put(keys, [b"v" * 8] * len(keys)) == [Status.OK] * len(keys)
        got = cl.get(keys)
        assert all(g is not None and bytes(g) == b"v" * 8 for g in got)
    per_owner = {n: opened.count(n) for n in set(opened)}
    assert per_owner and max(per_owner.values()) <= 2 * fanout.MAX_CONNECTS_PER_OWNER, per_owner


def test_exists_takes_a_timeout_of_its_own(make_cluster):
    """The SGLang adapter gives one very large existence round (a 128k-token prompt at page size
    1: 262,144 keys) more than the client's timeout, where it was a whole miss (a prober)."""
    import os

    c = make_cluster(nodes=1)
    with Client(c.addresses, timeout_s=0.2, on_node_error=OnNodeError.MISS) as cl:
        assert cl.exists(["k"]) == [False]  # a pooled connection first
        sigstop(c.daemons[0].pid)
        try:
            t0 = time.monotonic()
            assert cl.exists(["k"], timeout_s=1.0) == [False]
            assert 0.9 <= time.monotonic() - t0 < 3.0
            t0 = time.monotonic()
            assert cl.exists(["k"]) == [False]
            assert time.monotonic() - t0 < 0.8
        finally:
            os.kill(c.daemons[0].pid, signal.SIGCONT)
        with pytest.raises(ValueError, match="timeout_s"):
            cl.exists(["k"], timeout_s=float("nan"))


@pytest.mark.parametrize("local", [LocalPath.OFF, LocalPath.FORCE])
def test_a_connect_to_a_stalled_daemon_ends_by_the_calls_deadline(make_cluster, local):
    """A fresh connection to a daemon that accepts TCP but never answers (stopped, or half
    partitioned) waited the whole connect timeout (0.5 s) whatever the call's timeout_s: a get
    with timeout_s 0.05 took 0.51 s (a prober). The connect is bounded by the call's deadline."""
    import os
    import time

    c = make_cluster(nodes=2)
    keys = [f"k{i}" for i in range(40)]
    with Client(c.addresses) as writer:
        assert writer.put(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
        victim = c.daemons[0]
        mine = [k for k, o in zip(keys, writer.owners(keys)) if o in (victim.node_id, victim.address)]
    assert mine
    sigstop(victim.pid)
    try:
        with Client(c.addresses, local=local, timeout_s=0.1, connect_timeout_s=1.0,
                    on_node_error=OnNodeError.MISS) as cl:  # fresh: nothing pooled
            t0 = time.monotonic()
            got = cl.get(mine[:4])
            took = time.monotonic() - t0
        assert got == [None] * len(got)
        assert took < 0.6, f"a get with timeout_s 0.1 took {took:.2f} s (connect timeout 1.0 s)"
    finally:
        os.kill(victim.pid, signal.SIGCONT)


def test_a_put_of_many_keys_whose_metadata_exceeds_one_frame_is_stored(make_cluster):
    """17,000 keys of 1,000 bytes with 1-byte values: the client sent one request whose metadata
    was over the daemon's 16 MiB limit; the daemon closed the connection and the put failed whole
    as "Connection reset by peer" (a prober). Now it goes out in requests the daemon takes."""
    c = make_cluster(nodes=1)
    keys = [f"{i:08d}".ljust(1000, "k") for i in range(17_000)]
    with Client(c.addresses, local=LocalPath.OFF, timeout_s=60.0) as cl:  # TCP: split by bytes
        assert cl.put(keys, [b"v"] * len(keys)) == [Status.OK] * len(keys)
        assert all(cl.exists(keys[::997]))


def test_calls_racing_close_end_with_client_closed_not_a_grpc_error(mastered):
    """With nothing owning keys every call asks the masters for the membership; a close() from
    another thread closed the gRPC channel under those refreshes, and 48 of 64 threads got a bare
    ValueError "Cannot invoke RPC on closed channel!" (a prober). Each ends with a result or a
    gcache error, and once closed, ClientClosed."""
    c = mastered
    mc = MasterClient(c.master_url, c.token, timeout_s=2.0)
    clients = [Client(c.master_url, token=c.token, timeout_s=2.0) for _ in range(3)]
    c.kill(0, signal.SIGSTOP)
    assert poll(lambda: all(r["state"] == "down" for r in mc.membership()["nodes"]), 10)
    epoch = mc.membership()["epoch"]
    mc.close()
    for cl in clients:
        assert poll(lambda cl=cl: cl._view.epoch >= epoch, 5)
        assert race_close(cl) == ["closed"] * 16


def race_close(cl, threads=16):
    """``threads`` threads calling get() on ``cl`` until it raises ClientClosed (or 10 s), while
    this one closes it once the calls are under way: each thread's outcome."""
    from gcache.errors import ClientClosed, GCacheError

    go, outcomes, calls = threading.Event(), [], []

    def worker(i):
        go.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                cl.get([f"k{i}"])
                calls.append(i)
            except ClientClosed:
                outcomes.append("closed")
                return
            except GCacheError:
                calls.append(i)
            except Exception as exc:  # noqa: BLE001 (the bug: anything untyped)
                outcomes.append(repr(exc))
                return
        outcomes.append("never closed")

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    go.set()
    assert poll(lambda: len(calls) >= threads, 10)  # calls under way, refreshing
    cl.close()
    for t in ts:
        t.join(15)
    return outcomes


def test_a_call_out_of_time_does_not_turn_the_local_path_off():
    """A local dial cut short by the call's own deadline was taken for a failure of the local
    path: every connection to that node went over TCP for 5 s (a reviewer)."""
    from gcache.client.pool import Pool
    from gcache.errors import CallTimeout

    pool = Pool(connect_timeout_s=0.5, local=LocalPath.AUTO)
    with pytest.raises(CallTimeout):
        pool.get("n0", "127.0.0.1:7000", deadline=time.monotonic() - 0.001)
    assert pool.is_local("n0", "127.0.0.1:7000")
    pool.close()
