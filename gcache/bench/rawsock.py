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
from gcache.net.wire import recv_exact, send_all, tune

REQ = struct.Struct("<cQ")


def serve(max_bytes: int) -> None:
    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    buf = memoryview(bytearray(max_bytes))
    buf[:] = b"\x5a" * max_bytes

    def conn_loop(sock: socket.socket) -> None:
        tune(sock)
        req = memoryview(bytearray(REQ.size))
        try:
            while True:
                recv_exact(sock, req)
                op, n = REQ.unpack(req)
                if op == b"G":
                    send_all(sock, [buf[:n]])
                else:
                    recv_exact(sock, buf[:n])
                    sock.sendall(b"k")
        except (OSError, ConnectionError):
            sock.close()

    while True:
        s, _ = lsock.accept()
        threading.Thread(target=conn_loop, args=(s,), daemon=True).start()


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

    def get(self, n: int) -> None:
        send_all(self.stream, [REQ.pack(b"G", n)])
        recv_exact(self.stream, self.buf[:n])

    def put(self, n: int) -> None:
        send_all(self.stream, [REQ.pack(b"P", n), self.buf[:n]])
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
