"""In-process streams: a connected pair of :class:`MemoryStream` ends, and a registry of in-memory
listeners, so the client and the daemon's handler can be run and tested together without
processes or sockets (``Client(..., transport=Transport.MEMORY)`` against :func:`listen`).

Socket semantics: ``recv_into`` returns what has arrived (waiting for at least one byte), 0
once the peer closed and everything was read; ``TimeoutError`` past the timeout;
``BlockingIOError`` when non-blocking (timeout 0, or MSG_DONTWAIT) with nothing to read;
``BrokenPipeError`` when sending to a closed peer. Not pollable: waits go through
:meth:`MemoryStream.wait_readable`.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

_cond = threading.Condition()  # one for every memory stream: they are for tests, not for speed
_listeners: dict[str, Callable[[MemoryStream], None]] = {}
_fds = itertools.count(1 << 30)  # fake descriptor numbers, unique per stream


class MemoryStream:
    pollable = False

    def __init__(self) -> None:
        self._inbox = bytearray()
        self._peer: MemoryStream | None = None
        self._closed = False  # this end was closed
        self._eof = False  # the peer closed (or shut down writing)
        self._timeout: float | None = None
        self._fd = next(_fds)

    @classmethod
    def pair(cls) -> tuple[MemoryStream, MemoryStream]:
        a, b = cls(), cls()
        a._peer, b._peer = b, a
        return a, b

    def __repr__(self) -> str:
        return f"MemoryStream(fd={self._fd}, buffered={len(self._inbox)}, closed={self._closed})"

    # -- the Stream interface -------------------------------------------------------------------
    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
        view = memoryview(buffer).cast("B")
        want = min(nbytes or len(view), len(view))
        if not want:
            return 0
        nonblocking = self._timeout == 0.0 or bool(flags & socket.MSG_DONTWAIT)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        with _cond:
            while not self._inbox:
                if self._closed:
                    raise OSError("stream closed")
                if self._eof:
                    return 0
                if nonblocking:
                    raise BlockingIOError("nothing to read")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("timed out")
                _cond.wait(remaining)
            n = min(want, len(self._inbox))
            view[:n] = self._inbox[:n]
            del self._inbox[:n]
            return n

    def sendmsg(self, buffers: Iterable[Any], /) -> int:
        total = 0
        with _cond:
            peer = self._peer
            if self._closed:
                raise OSError("stream closed")
            if peer is None or peer._closed or peer._eof:
                raise BrokenPipeError("the peer closed the stream")
            for b in buffers:
                chunk = memoryview(b).cast("B")
                peer._inbox += chunk
                total += len(chunk)
            _cond.notify_all()
        return total

    def settimeout(self, timeout: float | None, /) -> None:
        self._timeout = timeout

    def gettimeout(self) -> float | None:
        return self._timeout

    def setblocking(self, flag: bool, /) -> None:
        self._timeout = None if flag else 0.0

    def fileno(self) -> int:
        return self._fd

    def hung_up(self) -> bool:
        with _cond:
            return self._eof or self._peer is None or self._peer._closed

    def shutdown(self, how: int, /) -> None:
        with _cond:
            if self._peer is not None:
                self._peer._eof = True  # the peer reads EOF; so do we (as a socket shut down both ways)
            self._eof = True
            _cond.notify_all()

    def close(self) -> None:
        with _cond:
            self._closed = True
            if self._peer is not None:
                self._peer._eof = True
            _cond.notify_all()

    def abort(self) -> None:
        with _cond:
            if self._peer is not None:
                self._peer._inbox.clear()  # what was not read yet is dropped, like a reset
        self.close()

    def peer(self) -> str:
        return "memory peer"

    def idle_ok(self) -> bool:
        with _cond:
            return not self._closed and not self._eof and not self._inbox

    @staticmethod
    def wait_readable(streams: Sequence[MemoryStream], deadline: float) -> list[MemoryStream]:
        """Those of ``streams`` with bytes to read (or EOF) by ``deadline``; [] when none."""
        with _cond:
            while True:
                ready = [s for s in streams if s._inbox or s._eof or s._closed]
                remaining = deadline - time.monotonic()
                if ready or remaining <= 0:
                    return ready
                _cond.wait(remaining)


def listen(address: str, on_connect: Callable[[MemoryStream], None]) -> None:
    """Accept in-memory connections to ``address``: each dial calls ``on_connect`` with the
    server's end (in the dialling thread: start a thread there to serve it)."""
    with _cond:
        if address in _listeners:
            raise OSError(f"memory address {address} is already listened on")
        _listeners[address] = on_connect


def unlisten(address: str) -> None:
    with _cond:
        _listeners.pop(address, None)


def dial(address: str) -> MemoryStream:
    """Connect to the in-memory listener at ``address``; ConnectionRefusedError when none."""
    with _cond:
        on_connect = _listeners.get(address)
    if on_connect is None:
        raise ConnectionRefusedError(f"no in-memory listener at {address}")
    client, server = MemoryStream.pair()
    on_connect(server)
    return client
