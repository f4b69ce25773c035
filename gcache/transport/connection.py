"""The caller's side of the gcache protocol over one Stream: framed requests, replies in order.

Stream failures are translated here, once, into gcache's typed errors. Every operation runs
against a deadline; a connection that failed mid-frame is closed, never reused. Used by the
client's pool and by daemons asking their peers (gcache.server.vouch).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from gcache import protocol as P
from gcache.errors import CallTimeout, ConnectionFailed, GCacheError, ProtocolError, ServerError
from gcache.net.stream import PolledSocketStream, SocketStream, Stream
from gcache.net.wire import DRAIN_CHUNK, IOV_MAX, drain, recv_exact, recv_scatter, send_all

READ_BUFFER = 64 << 10  # per connection: replies up to this size take one read


class _IO:
    """The error translation of Connection._io (a class, not a generator: it runs per read)."""

    __slots__ = ("conn",)

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if kind is None:
            return
        conn = self.conn
        if issubclass(kind, TimeoutError):
            conn.broken = True
            raise CallTimeout(conn.node, conn._timeout) from None
        if issubclass(kind, OSError):
            conn.broken = True
            raise ConnectionFailed(conn.node, str(exc) or kind.__name__) from None


class Connection:
    """Requests to one daemon over ``stream`` (already connected; see gcache.transport.open_connection)."""

    def __init__(self, node: str, address: str, stream: Stream, timeout_s: float) -> None:
        self.node = node
        self.address = address
        self.stream = stream
        self.broken = False
        self._rbuf = memoryview(bytearray(READ_BUFFER))
        self._r0 = self._r1 = 0  # the unread bytes are _rbuf[_r0:_r1]
        self._next_id = 1
        self._pending: list[int] = []
        self._out: list[Any] = []
        self._out_i = 0
        self._out_left = 0
        self._timeout = timeout_s
        self.arena: memoryview | None = None  # the daemon's arena, mapped read-only (local path only)
        self.arena_id = ""  # which incarnation of the daemon's arena that is
        self.last_epoch = 0
        self._guard = _IO(self)
        # A polled socket takes the deadline itself (no syscall); other streams a timeout.
        self._polled = stream if isinstance(stream, PolledSocketStream) else None
        self._send_nowait: Callable[[list[Any]], int] | None = (
            self._polled.sendmsg_nowait if self._polled is not None else None)

    def hello(self, token: str | None, deadline: float, check_node: bool = False) -> None:
        """The data-plane handshake: prove the cluster token once (nothing to do without one),
        and with ``check_node`` make sure the daemon that answers is ``self.node`` (its HELLO
        reply names it): a client routing by node ids must never be served by another node that
        happens to answer at the address it dialled (a wildcard or loopback address in the
        membership, an address reused by another daemon). On failure the connection is closed
        and the typed error raised (ConnectionFailed for another node)."""
        if token is None and not check_node:
            return
        try:
            reply = self.call(P.Op.HELLO, {} if token is None else {"token": token}, deadline)
            if check_node and reply.get("node") != self.node:
                raise ConnectionFailed(self.node, f"{self.address} is answered by node {reply.get('node')!r}, not "
                                                  f"{self.node!r}: the membership's address for {self.node!r} leads "
                                                  "to another daemon; refused")
        except GCacheError:
            self.close()
            raise

    @property
    def buffered(self) -> bool:
        """Whether bytes of a reply are already read into this connection's buffer."""
        return self._r1 > self._r0

    @property
    def pending(self) -> bool:
        """Whether a request on this connection is still unanswered."""
        return bool(self._pending)

    def __repr__(self) -> str:
        return f"Connection(node={self.node!r}, broken={self.broken}, pending={len(self._pending)})"

    def _io(self, deadline: float) -> _IO:
        """``with self._io(deadline):`` around stream calls: the stream's timeout set to what is
        left, and its failures turned into CallTimeout / ConnectionFailed (the connection broken)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.broken = True
            raise CallTimeout(self.node, self._timeout)
        if self._polled is not None:
            self._polled.deadline = deadline
        else:
            self.stream.settimeout(remaining)
        return self._guard

    def prepare(self, op: int, meta: dict[str, Any], payload: Sequence[memoryview], timeout_s: float) -> int:
        """Queue one request frame for send_some(); returns its request id."""
        self._timeout = timeout_s
        raw = P.encode_meta(meta)
        parts = [v for v in payload if len(v)]
        total = sum(map(len, parts))
        req_id = self._next_id
        self._next_id += 1
        head = P.pack_header(op, 0, req_id, len(raw), total) + raw
        self._out = [head, *parts]
        self._out_i = 0
        self._out_left = len(head) + total  # bytes of the frame not sent yet
        self._pending.append(req_id)
        return req_id

    def send_some(self, deadline: float) -> bool:
        """Send queued bytes without blocking; True once the whole frame is out."""
        with self._io(deadline):
            send = self._send_nowait
            if send is None:
                self.stream.setblocking(False)
                send = self.stream.sendmsg
            out, i = self._out, self._out_i
            try:
                while i < len(out):
                    sent = send(out[i : i + IOV_MAX])
                    self._out_left -= sent
                    if not self._out_left:  # the usual case: the rest of the frame left at once
                        i = len(out)
                        break
                    while sent:
                        if sent >= len(out[i]):
                            sent -= len(out[i])
                            i += 1
                        else:
                            out[i] = memoryview(out[i])[sent:]
                            sent = 0
            except BlockingIOError:
                pass
            self._out_i = i
            if i == len(out):
                self._out = []
                return True
            return False

    def send_oneway(self, op: int, meta: dict[str, Any], deadline: float) -> None:
        """A request the daemon does not answer (FLAG_NOREPLY)."""
        raw = P.encode_meta(meta)
        with self._io(deadline):
            send_all(self.stream, [P.pack_header(op, P.FLAG_NOREPLY, 0, len(raw), 0) + raw])

    def send(self, op: int, meta: dict[str, Any], payload: Sequence[memoryview], deadline: float,
             timeout_s: float) -> int:
        """Send one whole request frame (blocking until the deadline)."""
        req_id = self.prepare(op, meta, payload, timeout_s)
        with self._io(deadline):
            send_all(self.stream, self._out)
        self._out = []
        return req_id

    # -- reading: a per-connection buffer takes whatever has arrived (header, metadata and often
    # the start of the payload) in one read; the payload readers below take from it first.
    def _fill(self, n: int) -> memoryview:
        """At least ``n`` (<= READ_BUFFER) unread bytes in the buffer; returns a view of the first n."""
        buf, r0, r1 = self._rbuf, self._r0, self._r1
        if r1 - r0 < n:
            if r0:
                buf[: r1 - r0] = buf[r0:r1]
                r1 -= r0
                r0 = self._r0 = 0
            while r1 < n:
                got = self.stream.recv_into(buf[r1:])
                if not got:
                    self._r1 = r1
                    raise ConnectionResetError(f"peer closed the connection ({r1} of {n} bytes received)")
                r1 += got
            self._r1 = r1
        return buf[r0:r0 + n]

    def _buffered(self, view: memoryview) -> int:
        """Copy what the buffer holds into the start of ``view``; returns how many bytes."""
        n = min(self._r1 - self._r0, len(view))
        if n:
            view[:n] = self._rbuf[self._r0:self._r0 + n]
            self._r0 += n
        return n

    def recv_reply(self, deadline: float) -> tuple[dict[str, Any], int]:
        """Header and metadata of the next reply: (meta, payload length). An ERROR reply raises
        ServerError (the connection stays usable: error replies carry no payload)."""
        with self._io(deadline):
            hdr = self._fill(P.HEADER_SIZE)
            try:
                version, _op, flags, req_id, meta_len, payload_len = P.unpack_header(hdr)
            except ValueError as exc:
                self.broken = True
                raise ProtocolError(f"{self.node}: {exc}") from None
            expected = self._pending.pop(0) if self._pending else None
            if version != P.VERSION or not flags & P.FLAG_REPLY or req_id not in (expected, 0):
                self.broken = True
                raise ProtocolError(f"{self.node}: unexpected reply (version {version}, id {req_id}, "
                                    f"expected {expected})")
            self._r0 += P.HEADER_SIZE
            if meta_len <= READ_BUFFER:
                raw = self._fill(meta_len)
                self._r0 += meta_len
            else:
                raw = memoryview(bytearray(meta_len))
                recv_exact(self.stream, raw[self._buffered(raw):])
        try:
            meta = P.decode_meta(raw)
        except ValueError as exc:
            self.broken = True
            raise ProtocolError(f"{self.node}: {exc}") from None
        if flags & P.FLAG_ERROR:
            if req_id == 0 or payload_len:
                self.broken = True
            raise ServerError(self.node, int(meta.get("code", 0)), str(meta.get("msg", "refused")))
        return meta, payload_len

    def call(self, op: int, meta: dict[str, Any], deadline: float, keep_payload: bool = False) -> dict[str, Any]:
        """One request without payload, and its reply's metadata. Unless ``keep_payload``, a reply
        payload is an error. The reply's epoch is kept in ``last_epoch``."""
        self.send(op, meta, [], deadline, self._timeout)
        reply, plen = self.recv_reply(deadline)
        if plen and not keep_payload:
            self.broken = True
            raise ProtocolError(f"{self.node}: unexpected payload in a {P.Op(op).name} reply")
        ep = reply.get("ep")
        if isinstance(ep, int):
            self.last_epoch = ep
        return reply

    def map_arena(self, deadline: float, writable: bool = False) -> tuple[dict[str, Any], int]:
        """LMAP: a descriptor of the daemon's arena memfd (passed over SCM_RIGHTS) and {"size",
        "id"}; a read-only one unless ``writable``. Only over a Unix socket stream."""
        stream = self.stream
        if not isinstance(stream, SocketStream):
            raise ConnectionFailed(self.node, "the local path needs a Unix socket stream")
        if self._r0 != self._r1:
            self.broken = True
            raise ProtocolError(f"{self.node}: unexpected bytes before LMAP")
        self.send(P.Op.LMAP, {"rw": True} if writable else {}, [], deadline, self._timeout)
        buf, fds = bytearray(), []
        with self._io(deadline):
            need = P.HEADER_SIZE
            while len(buf) < need:
                msg, got = stream.recv_fds(65536, 1)
                if not msg:
                    raise ConnectionResetError("peer closed the connection during LMAP")
                buf += msg
                fds += got
                if len(buf) >= P.HEADER_SIZE:
                    need = P.HEADER_SIZE + P.unpack_header(buf[: P.HEADER_SIZE])[4]
        self._pending.pop(0)
        _v, _op, flags, _rid, _mlen, _plen = P.unpack_header(buf[: P.HEADER_SIZE])
        meta = P.decode_meta(bytes(buf[P.HEADER_SIZE:need]))
        if flags & P.FLAG_ERROR or not fds:
            for fd in fds:
                os.close(fd)
            raise ServerError(self.node, int(meta.get("code", 0)), str(meta.get("msg", "no arena descriptor")))
        for fd in fds[1:]:
            os.close(fd)
        return meta, fds[0]

    def recv_into(self, view: memoryview, deadline: float) -> None:
        with self._io(deadline):
            n = self._buffered(view)
            if n < len(view):
                recv_exact(self.stream, view[n:])

    def recv_scatter(self, views: Sequence[memoryview], deadline: float) -> None:
        """Fill ``views`` in order (a reply's values, one syscall for many where possible)."""
        with self._io(deadline):
            i = 0
            while i < len(views) and self._r0 < self._r1:  # what the buffer already holds
                n = self._buffered(views[i])
                if n < len(views[i]):
                    recv_scatter(self.stream, [views[i][n:], *views[i + 1:]])
                    return
                i += 1
            recv_scatter(self.stream, views[i:])

    def discard(self, nbytes: int, deadline: float) -> None:
        with self._io(deadline):
            held = min(nbytes, self._r1 - self._r0)
            self._r0 += held
            if nbytes > held:
                drain(self.stream, nbytes - held, memoryview(bytearray(min(nbytes - held, DRAIN_CHUNK))))

    def idle_ok(self) -> bool:
        """An idle connection must have nothing to read: readable means the daemon closed it
        (it restarted or died), so it must not be reused."""
        return self._r0 == self._r1 and self.stream.idle_ok()

    def close(self) -> None:
        self.broken = True
        try:
            if self._pending:
                # A request is still unanswered (timed out, or failed mid-frame): reset rather
                # than close, so the kernel drops what it has not delivered yet instead of
                # retransmitting it once the path heals. A write given up on must not land
                # after a newer one to the same key.
                self.stream.abort()
            else:
                self.stream.close()
        except OSError:
            pass
