"""The Stream seam: the one byte-stream interface the daemon's Handler and the client's
Connection talk through (after httpcore's ``_backends``: a small interface both ends use, and
one implementation per carrier).

A Stream is the part of the socket API gcache needs: ``recv_into`` / ``sendmsg`` with socket
semantics (0 bytes = the peer closed; ``TimeoutError`` past the timeout; ``OSError`` on a
broken connection), timeouts, and close. Implementations: :class:`SocketStream` (TCP and Unix
sockets, in this module), ``gcache.transport.memory.MemoryStream`` (in-process pairs, for tests),
``gcache.transport.ucx.UcxStream`` (UCX tag messages).

A *pollable* stream has a real descriptor (``fileno()``) that select/poll can wait on; a stream
that is not (memory, UCX) is waited on with its class's ``wait_readable``.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

LINGER_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Stream(Protocol):
    """A connected, ordered, reliable byte stream."""

    pollable: bool

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int: ...

    def sendmsg(self, buffers: Iterable[Any], /) -> int: ...

    def settimeout(self, timeout: float | None, /) -> None: ...

    def gettimeout(self) -> float | None: ...

    def setblocking(self, flag: bool, /) -> None: ...

    def fileno(self) -> int: ...

    def shutdown(self, how: int, /) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None:
        """Close, dropping whatever was sent but not delivered yet (a TCP reset)."""

    def peer(self) -> str:
        """Who is at the other end, for messages."""

    def idle_ok(self) -> bool:
        """For a pooled idle stream: nothing to read and the peer still there."""


class SocketStream:
    """A Stream over a socket. The socket's own methods are bound as attributes, so a call
    through the seam costs exactly what a call on the socket costs."""

    pollable = True
    __slots__ = ("close", "fileno", "gettimeout", "recv_into", "recvmsg_into", "sendmsg", "setblocking",
                 "settimeout", "shutdown", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.recv_into = sock.recv_into
        self.recvmsg_into = sock.recvmsg_into  # scatter reads (gcache.net.wire.recv_scatter)
        self.sendmsg = sock.sendmsg
        self.settimeout = sock.settimeout
        self.gettimeout = sock.gettimeout
        self.setblocking = sock.setblocking
        self.fileno = sock.fileno
        self.shutdown = sock.shutdown
        self.close = sock.close

    def __repr__(self) -> str:
        return f"SocketStream({self.peer()})"

    def abort(self) -> None:
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_ABORT)
        except OSError:
            pass
        self.sock.close()

    def peer(self) -> str:
        try:
            name = self.sock.getpeername()
        except OSError:
            return "?"
        if isinstance(name, tuple) and len(name) >= 2:
            return f"{name[0]}:{name[1]}"
        return "local client"  # a Unix socket peer has no address

    def idle_ok(self) -> bool:
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def send_fds(self, buffers: Sequence[Buffer], fds: Sequence[int]) -> int:
        """Send ``buffers`` with descriptors attached (SCM_RIGHTS; Unix sockets only)."""
        return socket.send_fds(self.sock, buffers, fds)

    def recv_fds(self, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
        """Receive up to ``bufsize`` bytes and the descriptors that came with them."""
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, bufsize, maxfds)
        return msg, list(fds)

    @staticmethod
    def wait_readable(streams: Sequence[SocketStream], deadline: float) -> list[SocketStream]:
        """Those of ``streams`` with bytes to read (or EOF) by ``deadline``; [] when none."""
        remaining = max(0.0, deadline - time.monotonic())
        readable, _, _ = select.select([s.sock for s in streams], [], [], remaining)
        ready = set(readable)
        return [s for s in streams if s.sock in ready]
