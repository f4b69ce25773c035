"""A client connection to one daemon, and the per-node pool of them.

Socket failures are translated here, once, into gcache's typed errors. Every operation runs
against a deadline; a connection that failed mid-frame is closed, never reused.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, Iterator

from gcache import protocol as P
from gcache.errors import CallTimeout, ConnectionFailed, GCacheError, ProtocolError, ServerError
from gcache.wire import DRAIN_CHUNK, IOV_MAX, drain, recv_exact, send_all, tune


class Connection:
    def __init__(self, node: str, address: str, connect_timeout_s: float, token: str | None = None) -> None:
        self.node = node
        self.address = address
        self.broken = False
        self._hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._next_id = 1
        self._pending: list[int] = []
        self._out: list[Any] = []
        self._out_i = 0
        self._timeout = connect_timeout_s
        host, _, port = address.rpartition(":")
        with self._io(time.monotonic() + connect_timeout_s):
            self.sock = socket.create_connection((host, int(port)), timeout=connect_timeout_s)
        tune(self.sock)
        if token is not None:  # the data-plane handshake: prove the cluster token once
            deadline = time.monotonic() + connect_timeout_s
            try:
                self.send(P.Op.HELLO, {"token": token}, [], deadline, connect_timeout_s)
                self.recv_reply(deadline)
            except GCacheError:
                self.close()
                raise

    def __repr__(self) -> str:
        return f"Connection(node={self.node!r}, broken={self.broken}, pending={len(self._pending)})"

    @contextmanager
    def _io(self, deadline: float) -> Iterator[None]:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self.broken = True
            raise CallTimeout(self.node, self._timeout)
        if getattr(self, "sock", None) is not None:
            self.sock.settimeout(remaining)
        try:
            yield
        except socket.timeout:
            self.broken = True
            raise CallTimeout(self.node, self._timeout) from None
        except OSError as exc:
            self.broken = True
            raise ConnectionFailed(self.node, str(exc) or type(exc).__name__) from None

    def prepare(self, op: int, meta: dict[str, Any], payload: Sequence[memoryview], timeout_s: float) -> int:
        """Queue one request frame for send_some(); returns its request id."""
        self._timeout = timeout_s
        raw = P.encode_meta(meta)
        total = sum(len(v) for v in payload)
        req_id = self._next_id
        self._next_id += 1
        self._out = [P.pack_header(op, 0, req_id, len(raw), total) + raw, *(v for v in payload if len(v))]
        self._out_i = 0
        self._pending.append(req_id)
        return req_id

    def send_some(self, deadline: float) -> bool:
        """Send queued bytes without blocking; True once the whole frame is out."""
        with self._io(deadline):
            self.sock.setblocking(False)
            out, i = self._out, self._out_i
            try:
                while i < len(out):
                    sent = self.sock.sendmsg(out[i : i + IOV_MAX])
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

    def send(self, op: int, meta: dict[str, Any], payload: Sequence[memoryview], deadline: float,
             timeout_s: float) -> int:
        """Send one whole request frame (blocking until the deadline)."""
        req_id = self.prepare(op, meta, payload, timeout_s)
        with self._io(deadline):
            send_all(self.sock, self._out)
        self._out = []
        return req_id

    def recv_reply(self, deadline: float) -> tuple[dict[str, Any], int]:
        """Header and metadata of the next reply: (meta, payload length). An ERROR reply raises
        ServerError (the connection stays usable: error replies carry no payload)."""
        with self._io(deadline):
            recv_exact(self.sock, self._hdr)
            try:
                version, _op, flags, req_id, meta_len, payload_len = P.unpack_header(self._hdr)
            except ValueError as exc:
                self.broken = True
                raise ProtocolError(f"{self.node}: {exc}") from None
            expected = self._pending.pop(0) if self._pending else None
            if version != P.VERSION or not flags & P.FLAG_REPLY or req_id not in (expected, 0):
                self.broken = True
                raise ProtocolError(f"{self.node}: unexpected reply (version {version}, id {req_id}, "
                                    f"expected {expected})")
            raw = bytearray(meta_len)
            recv_exact(self.sock, memoryview(raw))
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

    def recv_into(self, view: memoryview, deadline: float) -> None:
        with self._io(deadline):
            recv_exact(self.sock, view)

    def discard(self, nbytes: int, deadline: float) -> None:
        with self._io(deadline):
            drain(self.sock, nbytes, memoryview(bytearray(min(nbytes, DRAIN_CHUNK))))

    def idle_ok(self) -> bool:
        """An idle connection must have nothing to read: readable means the daemon closed it
        (it restarted or died), so it must not be reused."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass


class Pool:
    """Idle connections per node; a checked-out connection belongs to one call at a time."""

    def __init__(self, connect_timeout_s: float, max_idle_per_node: int = 8, token: str | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.token = token
        self.max_idle = max_idle_per_node
        self._idle: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()

    def get(self, node: str, address: str) -> Connection:
        with self._lock:
            idle = self._idle.get(node)
            while idle:
                conn = idle.pop()
                if conn.address == address and conn.idle_ok():
                    return conn
                conn.close()
        return Connection(node, address, self.connect_timeout_s, self.token)

    def put(self, conn: Connection) -> None:
        if conn.broken or conn._pending:
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(conn.node, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            conn.close()


def is_transport_error(exc: BaseException) -> bool:
    return isinstance(exc, GCacheError) and not isinstance(exc, ServerError)
