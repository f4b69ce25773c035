"""The daemon's Handler over a real socket pair: what its read-ahead buffer must not change
(pipelined frames, payloads that straddle the buffer, refusals that drain what was buffered)."""

import socket
import threading
import time

import pytest

from gcache import protocol as P
from gcache.net.stream import PolledSocketStream, SocketStream
from gcache.protocol import Op, Status
from gcache.server.handler import Handler, ServerContext
from gcache.tier.store import Store, StoreConfig
from gcache.transport import Connection
from tests.server.memory_daemon import serve_then_close


@pytest.fixture
def conn():
    store = Store(StoreConfig(mem_bytes=16 << 20, pretouch=False))
    ctx = ServerContext(store, "n1", 8 << 20)
    a, b = socket.socketpair()
    t = threading.Thread(target=serve_then_close, args=(Handler(SocketStream(a), ctx),), daemon=True)
    t.start()
    c = Connection("n1", "n1:1", PolledSocketStream(b), 5.0)
    yield c
    c.close()
    t.join(5)
    store.close()


def frame(op, meta, payload=b""):
    raw = P.encode_meta(meta)
    return P.pack_header(op, 0, 1, len(raw), len(payload)) + raw + payload


def test_pipelined_frames_in_one_send_are_each_answered(conn):
    values = [bytes([i]) * (3000 + i) for i in range(4)]  # a put straddles the 8 KiB read-ahead
    sizes = [len(v) for v in values]
    keys = [b"k%d" % i for i in range(4)]
    burst = (frame(Op.PUT, {"ns": "a", "keys": keys, "sizes": sizes}, b"".join(values))
             + frame(Op.EXISTS, {"ns": "a", "keys": [*keys, b"nope"]})
             + frame(Op.GET, {"ns": "a", "keys": keys}))
    conn.stream.sendmsg([burst])
    conn._pending += [1, 1, 1]
    deadline = time.monotonic() + 5
    meta, _ = conn.recv_reply(deadline)
    assert meta["st"] == [Status.OK] * 4
    meta, _ = conn.recv_reply(deadline)
    assert meta["st"] == [Status.OK] * 4 + [Status.NOT_FOUND]
    meta, plen = conn.recv_reply(deadline)
    assert meta["sz"] == sizes and plen == sum(sizes)
    got = memoryview(bytearray(plen))
    conn.recv_into(got, deadline)
    assert bytes(got) == b"".join(values)


def test_a_refused_put_drains_its_buffered_payload_and_the_next_frame_is_served(conn):
    burst = (frame(Op.PUT, {"ns": "a", "keys": [b"x"], "sizes": [5]}, b"0123456789")  # sizes do not add up
             + frame(Op.PUT, {"ns": "a", "keys": [b"y"], "sizes": [3]}, b"abc"))
    conn.stream.sendmsg([burst])
    conn._pending += [1, 1]
    deadline = time.monotonic() + 5
    with pytest.raises(Exception, match="sizes"):
        conn.recv_reply(deadline)
    meta, _ = conn.recv_reply(deadline)
    assert meta["st"] == [Status.OK]
    conn.send(Op.GET, {"ns": "a", "keys": [b"y", b"x"]}, [], deadline, 5.0)
    meta, plen = conn.recv_reply(deadline)
    assert meta["st"] == [Status.OK, Status.NOT_FOUND] and plen == 3
    got = memoryview(bytearray(3))
    conn.recv_into(got, deadline)
    assert bytes(got) == b"abc"
