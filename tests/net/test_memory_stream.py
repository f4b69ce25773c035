"""The in-memory Stream: socket semantics without sockets."""

import socket
import threading
import time

import pytest

from gcache.net.wire import recv_exact, send_all
from gcache.transport.memory import MemoryStream, dial, listen, unlisten


def test_bytes_arrive_in_order_and_in_pieces():
    a, b = MemoryStream.pair()
    assert send_all(a, [b"hello ", memoryview(b"wor"), bytearray(b"ld")]) is None
    buf = bytearray(4)
    assert b.recv_into(buf) == 4 and buf == b"hell"
    rest = memoryview(bytearray(7))
    recv_exact(b, rest)
    assert bytes(rest) == b"o world"


def test_timeout_and_nonblocking():
    _a, b = MemoryStream.pair()
    b.settimeout(0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        b.recv_into(bytearray(1))
    assert time.monotonic() - t0 >= 0.04
    b.settimeout(None)
    with pytest.raises(BlockingIOError):
        b.recv_into(bytearray(1), 0, socket.MSG_DONTWAIT)
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv_into(bytearray(1))


def test_close_is_eof_for_the_peer_and_a_broken_pipe_for_senders():
    a, b = MemoryStream.pair()
    a.sendmsg([b"xy"])
    a.close()
    buf = bytearray(8)
    assert b.recv_into(buf) == 2  # what was sent before the close is still read
    assert b.recv_into(buf) == 0  # then EOF
    with pytest.raises(BrokenPipeError):
        b.sendmsg([b"z"])
    assert not b.idle_ok()


def test_abort_drops_what_the_peer_has_not_read():
    a, b = MemoryStream.pair()
    a.sendmsg([b"never read"])
    a.abort()
    assert b.recv_into(bytearray(16)) == 0


def test_a_blocked_reader_wakes_on_data_and_wait_readable_reports_it():
    a, b = MemoryStream.pair()
    c, d = MemoryStream.pair()
    got = []
    reader = threading.Thread(target=lambda: got.append(b.recv_into(bytearray(3))))
    reader.start()
    assert MemoryStream.wait_readable([d], time.monotonic() + 0.01) == []
    a.sendmsg([b"abc"])
    c.sendmsg([b"!"])
    reader.join(5)
    assert got == [3]
    assert MemoryStream.wait_readable([b, d], time.monotonic() + 5) == [d]


def test_listen_and_dial():
    served = []
    listen("memory:9", served.append)
    try:
        client = dial("memory:9")
        client.sendmsg([b"ping"])
        buf = memoryview(bytearray(4))
        recv_exact(served[0], buf)
        assert bytes(buf) == b"ping"
        with pytest.raises(OSError):
            listen("memory:9", served.append)
    finally:
        unlisten("memory:9")
    with pytest.raises(ConnectionRefusedError):
        dial("memory:9")
