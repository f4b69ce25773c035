"""Bad requests to a master are refused with a reason and change nothing; what a caller without
the token sends is not even decoded; floods of them log a few lines.

Found by probes: a Register with the address "not-an-address" was accepted, went into the
membership, and every client and daemon failed on it (a membership they could not route by).
Unauthenticated Status calls with a 4 MB msgpack array of nils as the body grew the master's front
by ~32 MB each, for good (71 MB -> 410 MB after 10 calls); bodies that were not msgpack logged an
11-line traceback each and answered UNKNOWN; each Drain of an unknown node was a Raft entry; a
Heartbeat with ``inc: inf`` answered UNKNOWN; a sealed but malformed UDP heartbeat logged a
traceback per datagram.

The tests share one master (and one daemon, node0)."""

from __future__ import annotations

import socket

import grpc
import msgpack
import pytest

from gcache import Client
from gcache.cluster import LocalCluster
from gcache.errors import GCacheError
from gcache.meta import rpc
from gcache.meta.beat import beat_key, seal, unseal
from gcache.meta.fields import MAX_MESSAGE, cut, heartbeat_error
from gcache.meta.master import MAX_CAPACITY, register_error
from gcache.meta.master_client import MasterClient
from tests.conftest import poll

GOOD = {"node": "n1", "address": "127.0.0.1:7000", "capacity": 1 << 30}
NILS_4MB = b"\xdd" + (4_000_000).to_bytes(4, "big") + b"\xc0" * 4_000_000  # msgpack array32 of 4M nils


@pytest.mark.parametrize("field, value", [
    ("node", ""), ("node", 7), ("node", "x" * 256), ("node", "a\nb"), ("node", "\x1b[2J"), ("node", " "),
    ("address", "not-an-address"), ("address", "h:0"),
    ("address", "h:70000"), ("address", 5), ("address", "h" * 300 + ":1"), ("address", "a:1,b:2"),
    ("address", "a b:1"), ("address", "h\nx:1"), ("address", "[zz]:1"), ("address", "[::1:1"),
    ("address", "h:\u0661\u0662"), ("address", "::1:7400"), ("capacity", 0), ("capacity", -1),
    ("capacity", 1e30), ("capacity", MAX_CAPACITY + 1), ("capacity", "1"), ("capacity", True)])
def test_register_requests_are_checked_field_by_field(field, value):
    """(An address every client refuses, "a:1,b:2", would make every membership unusable: the
    masters refuse what gcache.net.address.address_error refuses.)"""
    assert register_error(GOOD) is None
    err = register_error({**GOOD, field: value})
    assert err is not None and f"'{field}'" in err and len(err) <= MAX_MESSAGE + 3


@pytest.mark.parametrize("req", [
    {}, {"node": "n", "inc": float("inf")}, {"node": "n", "inc": True}, {"node": ["n"], "inc": 1},
    {"node": "n", "inc": "1"}, {"node": "n", "inc": -1}, {"node": "n", "inc": 1 << 63}, {"node": "n", "inc": 1, "epoch": 1.5}])
def test_heartbeats_are_checked_field_by_field(req):
    assert heartbeat_error({"node": "n", "inc": 1, "epoch": 0}) is None
    assert heartbeat_error(req) is not None


def test_cut_bounds_what_an_error_quotes():
    assert cut("abc") == "abc" and len(cut("x" * 10_000)) == MAX_MESSAGE + 3


@pytest.fixture(scope="module")
def cl(tmp_path_factory):
    with LocalCluster(nodes=1, masters=1, mem="32MiB", root=str(tmp_path_factory.mktemp("c"))) as c:
        yield c


@pytest.fixture(scope="module")
def raw(cl):
    """call(name, body bytes, token=cl.token) -> (status code, details or the decoded reply),
    on a channel that sends anything."""
    ch = grpc.insecure_channel(cl.master_procs[0].address, options=[("grpc.max_send_message_length", 64 << 20)])

    def call(name, body, token=cl.token, stream=False):
        make = ch.unary_stream if stream else ch.unary_unary
        f = make(f"/{rpc.SERVICE}/{name}", request_serializer=lambda b: b, response_deserializer=rpc.unpack)
        md = [(rpc.TOKEN_HEADER, token)] if token else []
        try:
            out = f(body, metadata=md, timeout=20)
            return grpc.StatusCode.OK, next(iter(out)) if stream else out
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""

    yield call
    ch.close()


def front_rss_kb(cl):
    with open(f"/proc/{cl.master_procs[0].pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def log_text(cl):
    with open(cl.master_procs[0].log_path, errors="replace") as f:
        return f.read()


def wait_for_log(cl, text, start, timeout_s=10.0):
    """The master's log from offset ``start`` once it holds ``text`` (the core logs through a queue)."""
    poll(lambda: text in log_text(cl)[start:], timeout_s)
    return log_text(cl)[start:]


def test_a_master_refuses_a_malformed_registration_and_keeps_serving(cl):
    mc = MasterClient(cl.master_url, cl.token, timeout_s=5.0)
    for bad in ({**GOOD, "address": "not-an-address"}, {**GOOD, "capacity": 1e30}, {"node": "n2"}):
        with pytest.raises(GCacheError, match="Register: '"):
            mc.call("Register", bad)
    with pytest.raises(GCacheError, match="HandoverDone needs"):
        mc.call("HandoverDone", {"node": "node0", "epoch": 1e300})
    mc.close()
    with Client(cl.master_url, token=cl.token, timeout_s=5.0) as c:
        assert [n for n in c.membership.owners()] == ["node0"]
        assert c.put([b"k"], [b"v"])[0].name == "OK" and c.get([b"k"]) == [b"v"]


def test_an_unauthenticated_request_is_not_decoded_and_a_big_one_is_refused(cl, raw):
    """Before: 10 of these grew the front from 71 MB to 410 MB, and it kept it."""
    before = front_rss_kb(cl)
    for _ in range(10):
        code, _details = raw("Status", NILS_4MB, token=None)
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    grown_mb = (front_rss_kb(cl) - before) / 1024
    assert grown_mb < 40, f"the front grew by {grown_mb:.0f} MB for 10 refused calls"
    # with the token, a body over the request limit is refused before anything decodes it
    assert raw("Status", NILS_4MB)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert raw("Status", rpc.pack({"pad": "x" * (rpc.MAX_REQUEST_BYTES + 1)}))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    # the limit leaves room: the largest legitimate request is far smaller than this one
    code, out = raw("Status", rpc.pack({"brief": True, "pad": "x" * 8000}))
    assert code == grpc.StatusCode.OK and out["master"]["is_leader"]
    # and a request of many small items stays within the decoder's limits
    code, details = raw("Status", rpc.pack({"pad": [None] * 1000}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not msgpack within the limits" in details


def test_a_body_that_is_not_msgpack_is_refused_clearly_and_logged_a_few_times(cl, raw):
    """Before: UNKNOWN "Unexpected FormatError", and an 11-line traceback per call in the log."""
    start = len(log_text(cl))
    for _ in range(150):
        assert raw("Status", b"\xc1", token=None)[0] == grpc.StatusCode.UNAUTHENTICATED
        code, details = raw("Status", b"\xc1")
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not msgpack" in details, (code, details)
    for body in (b"", msgpack.packb([1, 2]), msgpack.packb(None), b"\x91" * 10_000 + b"\xc0"):
        code, details = raw("Register", body)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("Register: "), (code, details)
    out = wait_for_log(cl, "not msgpack", start)
    assert "refused Status" in out and "not msgpack" in out and "Traceback" not in out
    assert len(out.splitlines()) <= 20, out[-3000:]


@pytest.mark.parametrize("name, req, why", [
    ("Heartbeat", {"node": "node0", "inc": float("inf")}, "'inc'"),
    ("Heartbeat", {"node": "node0", "inc": True}, "'inc'"),
    ("Heartbeat", {"node": ["node0"], "inc": 1}, "'node'"),
    ("Heartbeat", {"node": "node0"}, "'inc'"),
    ("Rings", {"after": True}, "'after'"),
    ("Rings", {"after": "x"}, "'after'"),
    ("Rings", {"after": -5}, "'after'"),
    ("Status", {"brief": {"x": 1}}, "'brief'"),
    ("Status", {"front": "yes"}, "'front'"),
    ("HandoverDone", {"node": "node0", "epoch": True}, "'epoch'"),
    ("Drain", {"node": 5}, "'node'"),
    ("Drain", {"node": {"a": 1}}, "'node'"),
    ("Drain", {}, "'node'"),
    ("Drain", {"node": "x" * 10_000}, "'node'"),
    ("WatchMembership", {"known": "x"}, "'known'"),
    ("WatchMembership", {"known": True}, "'known'"),
    ("GetMembership", [1], "msgpack map"),
])
def test_every_rpc_checks_its_fields(cl, raw, name, req, why):
    code, details = raw(name, rpc.pack(req), stream=name == "WatchMembership")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and why in details, (code, details)
    assert len(details) <= MAX_MESSAGE + 3


def test_an_unknown_node_is_not_drained_and_costs_no_raft_entry(cl, raw):
    """Before: each refused Drain was committed to the Raft log (and its whole name echoed)."""
    def commit_idx():
        code, out = raw("Status", rpc.pack({"brief": True}))
        assert code == grpc.StatusCode.OK
        return out["master"]["commit_idx"]

    before = commit_idx()
    for i in range(20):
        code, details = raw("Drain", rpc.pack({"node": f"{i}" + "x" * 250}))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "unknown node" in details, (code, details)
        assert len(details) <= MAX_MESSAGE + 3
    assert commit_idx() == before
    # a known node still reaches Raft, which refuses to drain the last owner
    code, details = raw("Drain", rpc.pack({"node": "node0"}))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "last node" in details
    code, details = raw("Heartbeat", rpc.pack({"node": "nobody", "inc": 1}))
    assert code == grpc.StatusCode.OK and details["ok"] is False and details["reason"] == "unknown node"


def test_a_sealed_malformed_heartbeat_gets_an_error_and_a_few_log_lines(cl):
    """Before: no answer, and a traceback (9 lines) in the log for each datagram."""
    key = beat_key(cl.token)
    start = len(log_text(cl))
    port = int(cl.master_procs[0].address.rsplit(":", 1)[1])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(5.0)
        for _ in range(100):
            s.sendto(seal(key, {"v": 1}), ("127.0.0.1", port))  # too short for an error reply: none
        for i in range(100):
            s.sendto(seal(key, {"v": 1, "node": "n", "inc": "a", "seq": i, "pad": "x" * 16}), ("127.0.0.1", port))
            reply = unseal(key, s.recvfrom(1024)[0])
            assert reply == {"v": 1, "error": "bad request"}
        # the listener still answers a good one (it takes datagrams in order: the bad ones are done)
        s.sendto(seal(key, {"v": 1, "node": "nobody", "inc": 1, "seq": 1 << 40, "epoch": 0}), ("127.0.0.1", port))
        reply = unseal(key, s.recvfrom(1024)[0])
        assert reply is not None and reply["ok"] is False and reply["seq"] == 1 << 40
    out = wait_for_log(cl, "refused a heartbeat", start)
    assert "refused a heartbeat" in out and "Traceback" not in out
    assert len(out.splitlines()) <= 12, out[-3000:]
    assert cl.master_procs[0].proc.poll() is None


def test_the_master_still_serves_after_all_this(cl):
    with Client(cl.master_url, token=cl.token, timeout_s=5.0) as c:
        assert [n for n in c.membership.owners()] == ["node0"]
        assert c.put([b"k2"], [b"v2"])[0].name == "OK" and c.get([b"k2"]) == [b"v2"]
    assert "Traceback" not in log_text(cl)
