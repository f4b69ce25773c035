"""A Stream that reads ahead: a frame's header, metadata and a small payload usually arrive
together, and one receive into a small per-connection buffer takes them all (the daemon read a
request with two or three receives before: the header, then its metadata, then the payload).

Small reads (less than half the buffer) are served from the buffer, refilled with one receive
when empty; larger reads, and scatter reads once the buffer is empty, go straight into the
caller's memory, so a value is copied at most once more, and only the part of it that came in
with its frame's header. Everything else (sends, timeouts, close) is the wrapped stream's own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gcache.net.stream import Stream

READ_AHEAD = 8 << 10  # per connection: the metadata of a batch of ~100 keys


class ReadAheadStream:
    """``stream`` with a read-ahead buffer of ``size`` bytes (see the module's doc)."""

    __slots__ = ("_buf", "_r0", "_r1", "_recv", "_recvmsg", "close", "fileno", "gettimeout", "hung_up", "inner",
                 "pollable", "sendmsg", "setblocking", "settimeout", "shutdown")

    def __init__(self, stream: Stream, size: int = READ_AHEAD) -> None:
        self.inner = stream
        self._buf = memoryview(bytearray(size))
        self._r0 = self._r1 = 0  # the unread bytes are _buf[_r0:_r1]
        self._recv = stream.recv_into
        self._recvmsg = getattr(stream, "recvmsg_into", None)
        self.pollable = stream.pollable
        self.sendmsg = stream.sendmsg
        self.settimeout = stream.settimeout
        self.gettimeout = stream.gettimeout
        self.setblocking = stream.setblocking
        self.fileno = stream.fileno
        self.shutdown = stream.shutdown
        self.close = stream.close
        self.hung_up = stream.hung_up

    def __repr__(self) -> str:
        return f"ReadAheadStream({self.inner!r}, buffered={self._r1 - self._r0})"

    @property
    def buffered(self) -> int:
        """Bytes received and not read yet."""
        return self._r1 - self._r0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0, /) -> int:
        want = nbytes or len(buffer)
        r0, r1 = self._r0, self._r1
        if r0 == r1:
            if want >= len(self._buf) >> 1:
                return self._recv(buffer, want, flags)
            got = self._recv(self._buf, 0, flags)
            if not got:
                return 0
            r0, r1 = 0, got
            self._r1 = got
        n = min(want, r1 - r0)
        buffer[:n] = self._buf[r0 : r0 + n]
        self._r0 = r0 + n
        return n

    def recvmsg_into(self, buffers: Iterable[Any], /) -> tuple[int, list[Any], int, Any]:
        """Scatter read: from the buffer while it holds bytes (a short read), else one
        recvmsg_into of the wrapped stream (or one recv_into when it has none)."""
        if self._r0 == self._r1:
            if self._recvmsg is not None:
                return self._recvmsg(buffers)
            first = next(iter(buffers))
            return self._recv(first, len(first), 0), [], 0, None
        total = 0
        for b in buffers:
            n = min(len(b), self._r1 - self._r0)
            b[:n] = self._buf[self._r0 : self._r0 + n]
            self._r0 += n
            total += n
            if self._r0 == self._r1:
                break
        return total, [], 0, None

    def abort(self) -> None:
        self.inner.abort()

    def peer(self) -> str:
        return self.inner.peer()

    def idle_ok(self) -> bool:
        return self._r0 == self._r1 and self.inner.idle_ok()
