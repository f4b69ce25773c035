"""The client's polled socket stream (deadlines without socket timeouts) and the daemon's
read-ahead stream (header, metadata and small payload in one receive), over real socket pairs."""

import math
import socket
import threading
import time

import numpy as np
import pytest

from gcache.net.readahead import ReadAheadStream
from gcache.net.stream import PolledSocketStream, SocketStream
from gcache.net.wire import recv_exact, recv_scatter, send_all


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_polled_stream_waits_until_its_deadline_then_times_out(pair):
    a, _b = pair
    s = PolledSocketStream(a)
    assert a.gettimeout() == 0.0  # the socket itself never blocks
    s.deadline = time.monotonic() + 0.05
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        s.recv_into(bytearray(1))
    assert 0.04 <= time.monotonic() - t0 < 1.0
    s.deadline = time.monotonic() - 1  # already past: fails at once, without waiting
    with pytest.raises(TimeoutError):
        s.recv_into(bytearray(1))


def test_polled_stream_reads_what_arrives_before_the_deadline(pair):
    a, b = pair
    s = PolledSocketStream(a)
    s.settimeout(5.0)
    assert 4.0 < s.gettimeout() <= 5.0
    b.sendall(b"hello world")
    buf = memoryview(bytearray(11))
    recv_exact(s, buf)
    assert bytes(buf) == b"hello world"
    s.settimeout(None)
    assert s.deadline == math.inf and s.gettimeout() is None


def test_polled_stream_sends_a_frame_larger_than_the_socket_buffer(pair):
    a, b = pair
    s = PolledSocketStream(a)
    s.settimeout(5.0)
    big = bytes(range(256)) * 16384  # 4 MiB: many times what a socket buffer holds
    got = bytearray()

    def reader():
        while len(got) < len(big):
            chunk = b.recv(1 << 20)
            if not chunk:
                return
            got.extend(chunk)

    t = threading.Thread(target=reader)
    t.start()
    send_all(s, [big[:1000], memoryview(big)[1000:]])
    t.join(10)
    assert bytes(got) == big


def test_polled_stream_nowait_send_raises_instead_of_waiting(pair):
    a, _b = pair
    s = PolledSocketStream(a)
    s.deadline = math.inf
    with pytest.raises(BlockingIOError):
        while True:  # fill the socket buffer: the non-waiting send must refuse, not block
            s.sendmsg_nowait([b"x" * 65536])


def test_polled_stream_idle_check_sees_a_closed_peer(pair):
    a, b = pair
    s = PolledSocketStream(a)
    assert s.idle_ok()
    b.close()
    assert not s.idle_ok()


def test_read_ahead_takes_a_frame_in_one_receive_and_serves_the_rest_from_its_buffer(pair):
    a, b = pair
    calls = []

    class Counting(SocketStream):
        __slots__ = ()

    inner = Counting(a)
    raw = inner.recv_into

    def counted(buf, nbytes=0, flags=0):
        calls.append(nbytes or len(buf))
        return raw(buf, nbytes, flags)

    inner.recv_into = counted
    s = ReadAheadStream(inner, size=1024)
    b.sendall(b"H" * 24 + b"M" * 100 + b"P" * 50)
    hdr, meta = memoryview(bytearray(24)), memoryview(bytearray(100))
    recv_exact(s, hdr)
    recv_exact(s, meta)
    payload = [memoryview(bytearray(20)), memoryview(bytearray(30))]
    recv_scatter(s, payload)
    assert bytes(hdr) == b"H" * 24 and bytes(meta) == b"M" * 100
    assert b"".join(bytes(p) for p in payload) == b"P" * 50
    assert len(calls) == 1  # one receive for header, metadata and payload
    assert s.buffered == 0


def test_read_ahead_reads_large_values_straight_into_the_destination(pair):
    a, b = pair
    s = ReadAheadStream(SocketStream(a), size=1024)
    data = bytes(range(256)) * 64  # 16 KiB
    b.sendall(b"h" * 10 + data)
    hdr = memoryview(bytearray(10))
    recv_exact(s, hdr)  # the buffer now also holds the start of the value
    assert 0 < s.buffered <= 1024 - 10
    dest = memoryview(bytearray(len(data)))
    recv_scatter(s, [dest[:5000], dest[5000:]])
    assert bytes(dest) == data and s.buffered == 0


def test_read_ahead_reports_eof_and_keeps_sends_and_idle_checks(pair):
    a, b = pair
    s = ReadAheadStream(SocketStream(a))
    send_all(s, [b"ping"])
    assert b.recv(4) == b"ping"
    b.sendall(b"xy")
    one = bytearray(1)
    assert s.recv_into(one) == 1 and one == b"x"
    assert not s.idle_ok()  # a byte is still buffered: the connection is not idle
    assert s.recv_into(one) == 1 and one == b"y"
    b.close()
    assert s.recv_into(one) == 0


def test_scatter_send_and_receive_of_many_parts_across_partial_transfers(pair):
    """More parts than IOV_MAX and more bytes than the socket buffers hold: both sides resume
    mid-part, and every part ends up exactly where it belongs."""
    a, b = pair
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 4000, 3000).tolist()  # ~6 MB in 3,000 parts
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8).tobytes()
    offs = np.cumsum([0, *sizes]).tolist()
    out = [memoryview(bytearray(n)) for n in sizes]
    err = []

    def reader():
        try:
            recv_scatter(SocketStream(b), out)
        except OSError as exc:  # reported below
            err.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    send_all(SocketStream(a), [memoryview(data)[offs[i]:offs[i + 1]] for i in range(len(sizes))])
    t.join(30)
    assert not t.is_alive() and not err
    assert b"".join(bytes(o) for o in out) == data
