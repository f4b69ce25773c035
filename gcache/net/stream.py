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

import math
import select
import socket
import struct
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

POLLRDHUP = getattr(select, "POLLRDHUP", 0x2000)  # the peer shut down or closed its end (Linux)
LINGER_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection
MAX_POLL_S = 3600.0  # one poll() waits at most this long (its millisecond argument is a C int); longer waits loop

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

    def hung_up(self) -> bool:
        """The peer closed or reset its end. What it sent before stays readable after that, so a
        daemon may read a whole request and serve it after its client gave up on it."""


class SocketStream:
    """A Stream over a socket. The socket's own methods are bound as attributes, so a call
    through the seam costs exactly what a call on the socket costs."""

    pollable = True
    __slots__ = ("_hup", "close", "fileno", "gettimeout", "recv_into", "recvmsg_into", "sendmsg", "setblocking",
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
        self._hup: select.poll | None = None

    def __repr__(self) -> str:
        return f"SocketStream({self.peer()})"

    def hung_up(self) -> bool:
        poller = self._hup
        try:
            if poller is None:  # POLLHUP and POLLERR (a reset) are reported without asking
                poller = self._hup = select.poll()
                poller.register(self.sock, POLLRDHUP)
            return bool(poller.poll(0))
        except (ValueError, OSError):  # closed here meanwhile: gone all the same
            return True

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


class PolledSocketStream(SocketStream):
    """A SocketStream for a caller that works against deadlines (the client's Connection).

    The socket stays non-blocking for its whole life; a call that would block polls until
    ``deadline`` (a time.monotonic() value, an attribute the caller moves before each call) and
    raises TimeoutError past it. A socket timeout would cost an ioctl per change, and CPython
    polls before every receive on a socket with a timeout; here a receive whose bytes have
    arrived is one syscall. ``sendmsg_nowait`` sends what the socket takes without waiting
    (BlockingIOError when it takes nothing)."""

    __slots__ = ("_pin", "_pout", "_raw_recv_into", "_raw_recvmsg_into", "deadline", "sendmsg_nowait")

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock)
        sock.setblocking(False)
        self.deadline = math.inf
        self._raw_recv_into = sock.recv_into
        self._raw_recvmsg_into = sock.recvmsg_into
        self.sendmsg_nowait = sock.sendmsg
        self.recv_into = self._recv_into  # type: ignore[assignment]
        self.recvmsg_into = self._recvmsg_into  # type: ignore[assignment]
        self.sendmsg = self._sendmsg  # type: ignore[assignment]
        self.settimeout = self._settimeout
        self.gettimeout = self._gettimeout
        self.setblocking = self._setblocking
        self._pin = select.poll()
        self._pin.register(sock.fileno(), select.POLLIN)
        self._pout = select.poll()
        self._pout.register(sock.fileno(), select.POLLOUT)

    def __repr__(self) -> str:
        return f"PolledSocketStream({self.peer()})"

    def _wait(self, poller: Any) -> None:
        while True:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("timed out")
            if poller.poll(min(remaining, MAX_POLL_S) * 1000.0):  # (poll takes at most ~24.8 days)
                return

    def _polled(self, poller: Any, call: Any, *args: Any) -> Any:
        """``call(*args)`` on the non-blocking socket, waiting with ``poller`` (until the
        deadline) each time it would block."""
        while True:
            try:
                return call(*args)
            except BlockingIOError:
                self._wait(poller)

    def _recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
        return self._polled(self._pin, self._raw_recv_into, buffer, nbytes, flags)

    def _recvmsg_into(self, buffers: Iterable[Any], /) -> tuple[int, list[Any], int, Any]:
        return self._polled(self._pin, self._raw_recvmsg_into, buffers if type(buffers) is list else list(buffers))

    def _sendmsg(self, buffers: Iterable[Any], /) -> int:
        return self._polled(self._pout, self.sendmsg_nowait, buffers if type(buffers) is list else list(buffers))

    def _settimeout(self, timeout: float | None, /) -> None:
        """The deadline becomes now + ``timeout`` (None: no deadline); the socket stays non-blocking."""
        self.deadline = math.inf if timeout is None else time.monotonic() + timeout

    def _gettimeout(self) -> float | None:
        return None if self.deadline == math.inf else max(0.0, self.deadline - time.monotonic())

    def _setblocking(self, flag: bool, /) -> None:
        self.deadline = math.inf if flag else -math.inf

    def idle_ok(self) -> bool:
        try:
            return not self._pin.poll(0)
        except (OSError, ValueError):
            return False

    def recv_fds(self, bufsize: int, maxfds: int) -> tuple[bytes, list[int]]:
        return self._polled(self._pin, super().recv_fds, bufsize, maxfds)
