"""Stream helpers shared by the daemon and the client: exact receives and scatter-gather sends.

Payload is moved with ``recv_into`` a memoryview of its destination and ``sendmsg`` of
memoryviews of its source, so no bytes object of payload is ever built.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Sequence
from typing import Any, Protocol


class Receiver(Protocol):
    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int: ...


class Sender(Protocol):
    def sendmsg(self, buffers: Iterable[Any], /) -> int: ...


IOV_MAX = 1024
DRAIN_CHUNK = 1 << 20


def recv_exact(sock: Receiver, view: memoryview) -> None:
    """Fill ``view`` completely; raises ConnectionResetError on EOF."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionResetError(f"peer closed the connection ({got} of {total} bytes received)")
        got += n


def recv_scatter(sock: Receiver, views: Sequence[memoryview]) -> None:
    """Fill every view, in order: one recvmsg_into per IOV_MAX views where the stream has it
    (a socket), else one exact read per view. Raises ConnectionResetError on EOF."""
    recvmsg = getattr(sock, "recvmsg_into", None)
    if recvmsg is None:
        for v in views:
            recv_exact(sock, v)
        return
    bufs: list[Any] = [v for v in views if len(v)]
    left = sum(map(len, bufs))
    i = 0
    while i < len(bufs):
        n = recvmsg(bufs[i : i + IOV_MAX])[0]
        if n == 0:
            raise ConnectionResetError("peer closed the connection mid-payload")
        left -= n
        if not left:  # all in: no per-buffer bookkeeping
            return
        i = _advance(bufs, i, n)


def _advance(bufs: list[Any], i: int, n: int) -> int:
    """After ``n`` bytes moved from ``bufs[i:]``: the index of the first buffer not done, whose
    entry is cut to what is left of it."""
    while n:
        head = bufs[i]
        if n >= len(head):
            n -= len(head)
            i += 1
        else:
            bufs[i] = memoryview(head)[n:]
            n = 0
    return i


def drain(sock: Receiver, nbytes: int, scratch: memoryview) -> None:
    """Read and discard ``nbytes`` (the payload of a refused value), keeping the framing in sync
    (a stream with a ``discard`` of its own, UCX's, drops whole messages without reading them)."""
    discard = getattr(sock, "discard", None)
    if discard is not None:
        discard(nbytes)
        return
    while nbytes > 0:
        chunk = scratch[: min(nbytes, len(scratch))]
        recv_exact(sock, chunk)
        nbytes -= len(chunk)


def send_all(sock: Sender, buffers: Sequence[bytes | bytearray | memoryview]) -> None:
    """Send every buffer in order with sendmsg (scatter-gather), resuming after partial sends."""
    bufs: list[Any] = [b for b in buffers if len(b)]
    left = sum(map(len, bufs))
    i = 0
    while i < len(bufs):
        n = sock.sendmsg(bufs[i : i + IOV_MAX])
        left -= n
        if not left:  # all out: no per-buffer bookkeeping
            return
        i = _advance(bufs, i, n)


def tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def shutdown_quietly(sock: socket.socket) -> None:
    """shutdown(SHUT_RDWR), ignoring a socket that is already gone. On a listening socket this
    also wakes the thread blocked in accept(), which close() alone does not."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
