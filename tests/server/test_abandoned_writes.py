"""A write its client gave up on never lands after that.

A client that times out resets the connection and may write the key again, on another connection
or another node, and be acknowledged. The daemon may still hold the first request whole (what a
peer sent before a reset stays readable), having read it just before a stall (SIGSTOP, a long GC,
a wait in Agent.writable): landing it then would put the older value over the acknowledged newer
one. The daemon checks, under the store lock as the write lands, that the connection is still
there.

The stall here is a real one: the first write comes from a client a ring ahead of the node, so it
waits in Agent.writable until the node routes by that ring. In-process Agent, Handler and Store
(tests/server/test_routing_epochs.py's Node), over real Unix and TCP sockets."""

import socket
import struct
import threading
import time

import pytest

from gcache import protocol as P
from gcache.net.stream import PolledSocketStream, SocketStream
from gcache.protocol import Op, Status
from gcache.server.handler import Handler
from gcache.transport import Connection
from tests.conftest import poll, read
from tests.server.memory_daemon import serve_then_close
from tests.server.test_routing_epochs import NS, Node, announced, call  # noqa: F401  (fixture)

RESET = struct.pack("ii", 1, 0)


def socket_pair(transport):
    """(client end, daemon end) of a fresh connection."""
    if transport == "unix":
        return socket.socketpair()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        daemon, _ = listener.accept()
    return client, daemon


class Served:
    """Connections of ``node``'s daemon side served by the real Handler, one thread each."""

    def __init__(self, node, transport):
        self.node, self.transport = node, transport
        self.threads = []

    def open(self):
        client, daemon = socket_pair(self.transport)
        stream = SocketStream(daemon)
        t = threading.Thread(target=serve_then_close, args=(Handler(stream, self.node.ctx),), daemon=True)
        t.start()
        self.threads.append(t)
        return client

    def first_done(self):
        """The first connection's handler has finished (its write landed or was refused)."""
        return not self.threads[0].is_alive()


def send(sock, op, meta, payload=b""):
    raw = P.encode_meta(meta)
    sock.sendall(P.pack_header(op, 0, 1, len(raw), len(payload)) + raw + payload)


def give_up(sock):
    """What a client does with a connection whose request timed out: reset it."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
    sock.close()


@pytest.fixture
def node(announced):  # noqa: F811
    n = Node()
    yield n
    n.close()


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_a_put_its_client_gave_up_on_does_not_land_over_a_newer_acknowledged_one(node, transport):
    served = Served(node, transport)
    first = served.open()
    send(first, Op.PUT, {"ns": NS, "keys": [node.kept], "sizes": [3], "ep": node.e2}, b"old")
    assert poll(lambda: node.agent.write_waits == 1, 5)  # read whole, waiting to be written
    give_up(first)
    second = Connection("n0", "n0:1", PolledSocketStream(served.open()), 5.0)
    try:
        assert call(second, Op.PUT, {"ns": NS, "keys": [node.kept], "sizes": [3], "ep": node.e1},
                    b"new")["st"] == [Status.OK]
        node.learn_epoch()
        node.build_ring()  # the first write may go on now
        assert poll(served.first_done, 5)
        assert read(node.store, (NS, node.kept)) == b"new"
        assert node.store.stats().get("writes_abandoned") == 1
        # the connection that stayed is served as before
        assert call(second, Op.GET, {"ns": NS, "keys": [node.kept], "ep": node.e2})["st"] == [Status.OK]
    finally:
        second.close()


def test_a_delete_its_client_gave_up_on_does_not_land_either(node):
    assert node.store.put((NS, node.kept), b"v1") is Status.OK
    served = Served(node, "tcp")
    first = served.open()
    send(first, Op.DELETE, {"ns": NS, "keys": [node.kept], "ep": node.e2})
    assert poll(lambda: node.agent.write_waits == 1, 5)
    give_up(first)
    node.learn_epoch()
    node.build_ring()
    assert poll(served.first_done, 5)
    assert read(node.store, (NS, node.kept)) == b"v1"
    assert node.store.stats().get("writes_abandoned") == 1


def test_a_write_whose_client_waits_for_the_answer_lands(node):
    """The check refuses only writes whose connection is gone: a waiting client is answered."""
    served = Served(node, "tcp")
    conn = Connection("n0", "n0:1", PolledSocketStream(served.open()), 5.0)
    try:
        assert call(conn, Op.PUT, {"ns": NS, "keys": [node.kept], "sizes": [3], "ep": node.e1},
                    b"new")["st"] == [Status.OK]
        assert "writes_abandoned" not in node.store.stats()
        assert read(node.store, (NS, node.kept)) == b"new"
    finally:
        conn.close()


def test_a_write_whose_client_half_closed_is_answered_error_not_not_owner(node):
    """Half-closing while waiting for a write's answer is against the protocol: the write is
    dropped like an abandoned one, and the answer says ERROR (NOT_OWNER would send the client
    to refresh its membership for nothing)."""
    served = Served(node, "unix")
    sock = served.open()
    try:
        send(sock, Op.PUT, {"ns": NS, "keys": [node.kept], "sizes": [3], "ep": node.e2}, b"new")
        assert poll(lambda: node.agent.write_waits == 1, 5)
        sock.shutdown(socket.SHUT_WR)
        node.learn_epoch()
        node.build_ring()
        conn = Connection("n0", "n0:1", PolledSocketStream(sock), 5.0)
        conn._pending.append(1)  # the request sent by hand above
        reply, _plen = conn.recv_reply(time.monotonic() + 5)
        assert reply["st"] == [Status.ERROR]
        assert not node.store.exists((NS, node.kept)) and node.store.stats().get("writes_abandoned") == 1
    finally:
        sock.close()
