"""The raw-socket ceiling: plain blocking sockets moving the same bytes between two processes.

The server answers b"G"+u64 n with n bytes from a preallocated buffer, and b"P"+u64 n by
receiving n bytes into a preallocated buffer and answering one byte: the same request/response
shape as a gcache batch get/put, with nothing else in the way.
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import threading
import time

from gcache.net.stream import SocketStream, Stream
from gcache.net.wire import recv_exact, recv_scatter, send_all, tune

REQ = struct.Struct("<cQQ")  # op (b"G" / b"P"), bytes, bytes per message (0: one message)


def pieces(buf: memoryview, n: int, piece: int) -> list[memoryview]:
    """The first ``n`` bytes of ``buf`` as messages of ``piece`` bytes (one value each)."""
    step = piece or n or 1
    return [buf[i:min(i + step, n)] for i in range(0, n, step)]


def answer(stream: Stream, buf: memoryview) -> None:
    """Serve requests on ``stream`` until the peer goes away: a get is answered with n bytes of
    ``buf`` in messages of the asked size, a put's n bytes are received into ``buf`` and
    answered with one byte."""
    req = memoryview(bytearray(REQ.size))
    try:
        while True:
            recv_exact(stream, req)
            op, n, piece = REQ.unpack(req)
            if op == b"G":
                send_all(stream, pieces(buf, n, piece))
            else:
                recv_scatter(stream, pieces(buf, n, piece))  # one message a value, as gcache's
                send_all(stream, [b"k"])
    except (OSError, ConnectionError):
        stream.close()


def serve(max_bytes: int) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    buf = memoryview(bytearray(max_bytes))
    buf[:] = b"\x5a" * max_bytes
    while True:
        s, _ = lsock.accept()
        tune(s)
        threading.Thread(target=answer, args=(SocketStream(s), buf), daemon=True).start()


class RawSocketPeer:
    """A ceiling server in a child process, and a client connection to it."""

    module = "gcache.bench.rawsock"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, str(max_bytes)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        port = int(self.proc.stdout.readline())
        sock = socket.create_connection(("127.0.0.1", port))
        tune(sock)
        self.stream: Stream = SocketStream(sock)
        self.buf = memoryview(bytearray(max_bytes))
        self.buf[:] = b"\x01" * max_bytes
        self._one = memoryview(bytearray(1))

    def get(self, n: int, piece: int = 0) -> None:
        send_all(self.stream, [REQ.pack(b"G", n, piece)])
        recv_scatter(self.stream, pieces(self.buf, n, piece))  # one view a value, as gcache's

    def put(self, n: int, piece: int = 0) -> None:
        send_all(self.stream, [REQ.pack(b"P", n, piece), *pieces(self.buf, n, piece)])
        recv_exact(self.stream, self._one)

    def measure(self, op: str, n: int, seconds: float) -> tuple[float, list[float]]:
        """GB/s and per-request latencies (s) of ``op`` moving n bytes per request."""
        fn = self.get if op == "get" else self.put
        fn(n)  # warm
        lat: list[float] = []
        t_end = time.perf_counter() + seconds
        t0 = time.perf_counter()
        while True:
            t = time.perf_counter()
            fn(n)
            lat.append(time.perf_counter() - t)
            if t >= t_end:
                break
        return n * len(lat) / (time.perf_counter() - t0) / 1e9, lat

    def close(self) -> None:
        self.stream.close()
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
