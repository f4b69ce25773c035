"""Malformed and hostile frames: the caller learns why, the daemon keeps serving everyone else."""

import socket
import struct

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gcache import Client, Status
from gcache import protocol as P
from gcache.net.wire import recv_exact


def connect(address):
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5)
    return s


def read_reply(sock):
    hdr = bytearray(P.HEADER_SIZE)
    recv_exact(sock, memoryview(hdr))
    _version, _op, flags, req_id, meta_len, payload_len = P.unpack_header(hdr)
    meta = bytearray(meta_len)
    recv_exact(sock, memoryview(meta))
    payload = bytearray(payload_len)
    recv_exact(sock, memoryview(payload))
    return flags, req_id, P.decode_meta(meta), bytes(payload)


def frame(op, meta, payload=b"", req_id=1, version=P.VERSION, magic=P.MAGIC):
    raw = msgpack.packb(meta, use_bin_type=True)
    return struct.pack("<4sBBHQIQ", magic, version, op, 0, req_id, len(raw), len(payload)) + raw + payload


def closed(sock):
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def still_serves(address):
    with Client([address], timeout_s=2) as c:
        assert c.put_one("health", b"ok") is Status.OK
        return c.get_one("health") == b"ok"


def test_bad_magic_gets_an_error_and_the_connection_is_closed(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    s = connect(addr)
    s.sendall(frame(P.Op.PING, {}, magic=b"HTTP"))
    flags, _, meta, _ = read_reply(s)
    assert flags & P.FLAG_ERROR and meta["code"] == P.ErrorCode.BAD_FRAME and "magic" in meta["msg"]
    assert closed(s)
    assert still_serves(addr)


def test_wrong_version_is_refused_clearly(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    s = connect(addr)
    s.sendall(frame(P.Op.PING, {}, version=9))
    _flags, _, meta, _ = read_reply(s)
    assert meta["code"] == P.ErrorCode.BAD_VERSION and "version 9" in meta["msg"]
    assert still_serves(addr)


def test_unknown_opcode_and_bad_meta_keep_the_connection_usable(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    s = connect(addr)
    s.sendall(frame(99, {}, payload=b"junk", req_id=5))
    flags, req_id, meta, _ = read_reply(s)
    assert req_id == 5 and meta["code"] == P.ErrorCode.UNKNOWN_OP
    # sizes that do not add up to the payload: refused, payload drained, connection in sync
    s.sendall(frame(P.Op.PUT, {"ns": "d", "keys": [b"a"], "sizes": [10]}, payload=b"xyz", req_id=6))
    flags, req_id, meta, _ = read_reply(s)
    assert req_id == 6 and meta["code"] == P.ErrorCode.BAD_META and "sizes" in meta["msg"]
    s.sendall(frame(P.Op.GET, {"ns": "", "keys": [b"a"]}, req_id=7))
    assert read_reply(s)[2]["code"] == P.ErrorCode.BAD_META
    s.sendall(frame(P.Op.GET, [1, 2, 3], req_id=8))
    assert read_reply(s)[2]["code"] == P.ErrorCode.BAD_META
    s.sendall(frame(P.Op.PING, {}, req_id=9))
    flags, req_id, meta, _ = read_reply(s)
    assert req_id == 9 and not flags & P.FLAG_ERROR and meta["v"] == P.VERSION


def test_oversized_payload_is_refused_before_reading_it(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    s = connect(addr)
    hdr = struct.pack("<4sBBHQIQ", P.MAGIC, P.VERSION, P.Op.PUT, 0, 1, 0, 1 << 50)
    s.sendall(hdr)
    _flags, _, meta, _ = read_reply(s)
    assert meta["code"] == P.ErrorCode.TOO_LARGE
    assert closed(s)
    assert still_serves(addr)


def test_truncated_frames_and_vanishing_clients_lose_nothing(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    with Client([addr]) as c:
        c.put_one("kept", b"precious")
    for cut in (3, P.HEADER_SIZE + 2, P.HEADER_SIZE + 20):  # inside the header, meta, payload
        s = connect(addr)
        s.sendall(frame(P.Op.PUT, {"ns": "default", "keys": [b"torn"], "sizes": [1000]}, b"x" * 1000)[:cut + 10])
        s.close()
    with Client([addr]) as c:
        assert c.get_one("kept") == b"precious"
        assert c.get_one("torn") is None  # a half-received value never becomes visible
        assert c.stats()[addr]["ram_keys"] == 1


def test_pipelined_requests_are_answered_in_order(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    s = connect(addr)
    s.sendall(frame(P.Op.PUT, {"ns": "p", "keys": [b"a", b"b"], "sizes": [3, 2]}, b"AAABB", req_id=1)
              + frame(P.Op.GET, {"ns": "p", "keys": [b"b", b"zz", b"a"]}, req_id=2)
              + frame(P.Op.EXISTS, {"ns": "p", "keys": [b"a", b"q"]}, req_id=3))
    r1, r2, r3 = read_reply(s), read_reply(s), read_reply(s)
    assert [r[1] for r in (r1, r2, r3)] == [1, 2, 3]
    assert r1[2]["st"] == [0, 0]
    assert r2[2]["st"] == [Status.OK, Status.NOT_FOUND, Status.OK] and r2[2]["sz"] == [2, 0, 3]
    assert r2[3] == b"BBAAA"
    assert r3[2]["st"] == [Status.OK, Status.NOT_FOUND]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(min_size=0, max_size=200))
def test_header_decoder_never_crashes(raw):
    buf = (raw + bytes(P.HEADER_SIZE))[: P.HEADER_SIZE]
    try:
        P.unpack_header(buf)
    except ValueError:
        pass
    try:
        P.decode_meta(raw)
    except ValueError:
        pass


def test_fuzzed_frames_never_take_the_daemon_down(make_cluster):
    addr = make_cluster(nodes=1).addresses[0]
    with Client([addr]) as c:
        c.put_one("anchor", b"still here")

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(op=st.integers(0, 255), meta=st.one_of(
        st.binary(max_size=64),
        st.dictionaries(st.sampled_from(["ns", "keys", "sizes", "ttl", "x"]),
                        st.one_of(st.integers(-5, 1 << 40), st.text(max_size=8), st.binary(max_size=8),
                                  st.lists(st.one_of(st.binary(max_size=4), st.integers(-3, 64)), max_size=4)),
                        max_size=5).map(lambda m: msgpack.packb(m, use_bin_type=True))),
        payload=st.binary(max_size=64), declared=st.integers(0, 128), magic_ok=st.booleans())
    def fuzz(op, meta, payload, declared, magic_ok):
        s = connect(addr)
        hdr = struct.pack("<4sBBHQIQ", P.MAGIC if magic_ok else b"XXXX", P.VERSION, op, 0, 1, len(meta), declared)
        try:
            s.sendall(hdr + meta + payload)
            s.shutdown(socket.SHUT_WR)
            s.settimeout(5)
            while s.recv(65536):
                pass
        except OSError:
            pass
        finally:
            s.close()

    fuzz()
    with Client([addr]) as c:
        assert c.get_one("anchor") == b"still here"
    assert still_serves(addr)
