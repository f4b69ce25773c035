"""The raw UCX ceiling: the same request/response shape as gcache.bench.rawsock, over UCX tag
messages between two processes, with nothing of gcache's protocol in the way (each value one
message, as gcache sends them).

Both ends use UCX exactly as gcache's UCX transport does (gcache.transport.ucx: one worker per
connection in blocking-progress mode, the UCX_TLS / UCX_NET_DEVICES of the environment, worker
addresses exchanged over a TCP connection that then only watches liveness); requests and answers
are gcache.bench.rawsock's.
"""

from __future__ import annotations

import socket
import struct
import sys

from gcache.bench.rawsock import RawSocketPeer, answer
from gcache.net.stream import SocketStream
from gcache.net.wire import recv_exact, tune

LEN = struct.Struct("<I")


def _exchange(sock: socket.socket, mine: bytes) -> bytes:
    """Send our worker address, receive the peer's (length-prefixed, over the set-up socket)."""
    sock.sendall(LEN.pack(len(mine)) + mine)
    head = memoryview(bytearray(LEN.size))
    recv_exact(sock, head)
    peer = memoryview(bytearray(LEN.unpack(head)[0]))
    recv_exact(sock, peer)
    return bytes(peer)


def serve(max_bytes: int) -> None:
    from gcache.transport.ucx import setup
    from gcache.transport.ucx.stream import UcxStream

    lsock = socket.create_server(("127.0.0.1", 0))
    print(lsock.getsockname()[1], flush=True)
    sock, _ = lsock.accept()
    tune(sock)
    worker = setup.worker_for("127.0.0.1")
    peer = _exchange(sock, worker.address.tobytes())
    stream = UcxStream(worker, setup.endpoint(worker, "127.0.0.1", peer), 1, 0, SocketStream(sock))
    buf = memoryview(bytearray(max_bytes))
    buf[:] = b"\x5a" * max_bytes
    answer(stream, buf)


class RawUcxPeer(RawSocketPeer):
    """A UCX ceiling server in a child process, and a client endpoint to it (the socket peer's
    requests and timing, over a UcxStream)."""

    module = "gcache.bench.rawucx"

    def __init__(self, max_bytes: int) -> None:
        from gcache.transport.ucx import setup
        from gcache.transport.ucx.stream import UcxStream

        super().__init__(max_bytes)  # the child prints its port; we hold a plain TCP stream to it
        assert isinstance(self.stream, SocketStream)
        sock = self.stream.sock
        worker = setup.worker_for("127.0.0.1")
        peer = _exchange(sock, worker.address.tobytes())
        self.stream = UcxStream(worker, setup.endpoint(worker, "127.0.0.1", peer), 0, 1, self.stream)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
