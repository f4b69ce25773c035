"""A client connection to one daemon, and the per-node pool of them.

Socket failures are translated here, once, into gcache's typed errors. Every operation runs
against a deadline; a connection that failed mid-frame is closed, never reused.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from gcache import protocol as P
from gcache.errors import CallTimeout, ConnectionFailed, GCacheError, ProtocolError, ServerError
from gcache.wire import DRAIN_CHUNK, IOV_MAX, drain, recv_exact, send_all, tune

LINGER_ABORT = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection


class Connection:
    def __init__(self, node: str, address: str, connect_timeout_s: float, token: str | None = None,
                 unix: str | None = None) -> None:
        self.node = node
        self.address = address
        self.broken = False
        self._hdr = memoryview(bytearray(P.HEADER_SIZE))
        self._next_id = 1
        self._pending: list[int] = []
        self._out: list[Any] = []
        self._out_i = 0
        self._timeout = connect_timeout_s
        self.arena: memoryview | None = None  # the daemon's arena, mapped read-only (local path only)
        self.arena_id = ""  # which incarnation of the daemon's arena that is
        self.last_epoch = 0
        host, _, port = address.rpartition(":")
        with self._io(time.monotonic() + connect_timeout_s):
            if unix is not None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(connect_timeout_s)
                try:
                    self.sock.connect(unix)
                except OSError:
                    self.sock.close()
                    raise
            else:
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
        except TimeoutError:
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

    def send_oneway(self, op: int, meta: dict[str, Any], deadline: float) -> None:
        """A request the daemon does not answer (FLAG_NOREPLY)."""
        raw = P.encode_meta(meta)
        with self._io(deadline):
            self.sock.sendall(P.pack_header(op, P.FLAG_NOREPLY, 0, len(raw), 0) + raw)

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
        "id"}; a read-only one unless ``writable``."""
        self.send(P.Op.LMAP, {"rw": True} if writable else {}, [], deadline, self._timeout)
        buf, fds = bytearray(), []
        with self._io(deadline):
            need = P.HEADER_SIZE
            while len(buf) < need:
                msg, got, _flags, _addr = socket.recv_fds(self.sock, 65536, 1)
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
            recv_exact(self.sock, view)

    def discard(self, nbytes: int, deadline: float) -> None:
        with self._io(deadline):
            drain(self.sock, nbytes, memoryview(bytearray(min(nbytes, DRAIN_CHUNK))))

    def idle_ok(self) -> bool:
        """An idle connection must have nothing to read: readable means the daemon closed it
        (it restarted or died), so it must not be reused."""
        if not getattr(self.sock, "pollable", True):  # a socket-like transport (UCX) checks itself
            return self.sock.idle_ok()
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        self.broken = True
        try:
            if self._pending and getattr(self.sock, "pollable", True):
                # A request is still unanswered (timed out, or failed mid-frame): reset rather
                # than close, so the kernel drops what it has not delivered yet instead of
                # retransmitting it once the path heals. A write given up on must not land
                # after a newer one to the same key.
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_ABORT)
            self.sock.close()
        except (OSError, AttributeError):
            pass


def is_local_host(host: str) -> bool:
    """Whether HOST names this machine (loopback, or one of its own addresses)."""
    if host in ("localhost", "::1") or host.startswith("127."):
        return True
    try:
        return host in socket.gethostbyname_ex(socket.gethostname())[2]
    except OSError:
        return False


class Pool:
    """Idle connections per node; a checked-out connection belongs to one call at a time.

    With the local path on, a daemon on this host is reached over its Unix socket and its arena
    is mapped once per daemon incarnation (shared by every connection to it)."""

    def __init__(self, connect_timeout_s: float, max_idle_per_node: int = 8, token: str | None = None,
                 local: str = "auto", transport: str = "tcp") -> None:
        self.connect_timeout_s = connect_timeout_s
        self.token = token
        self.local = local  # "auto" | "off" | "force"
        self.transport = transport  # "tcp" | "ucx" (gcache.transport.Transport values)
        self._arenas: dict[str, tuple[str, mmap.mmap, memoryview]] = {}  # read-only mappings
        self._rw_arenas: dict[str, tuple[str, mmap.mmap, memoryview]] = {}  # writable ones (puts)
        self._no_local: dict[str, float] = {}  # node -> when the local path last failed
        self.max_idle = max_idle_per_node
        self._idle: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()

    def idle(self, node: str, address: str) -> Connection | None:
        """An idle connection to ``node`` that is still good, or None."""
        with self._lock:
            idle = self._idle.get(node)
            while idle:
                conn = idle.pop()
                if conn.address == address and conn.idle_ok():
                    return conn
                conn.close()
        return None

    def get(self, node: str, address: str) -> Connection:
        conn = self.idle(node, address)
        if conn is not None:
            return conn
        if self.transport == "ucx":
            from gcache.transport.ucx import connect

            return connect(node, address, self.connect_timeout_s, self.token)
        if self.local != "off" and is_local_host(address.rpartition(":")[0]):
            failed = self._no_local.get(node)
            if self.local == "force" or failed is None or time.monotonic() - failed > 5.0:
                try:
                    return self._local_connection(node, address)
                except GCacheError:
                    if self.local == "force":
                        raise
                    self._no_local[node] = time.monotonic()
        return Connection(node, address, self.connect_timeout_s, self.token)

    def _local_connection(self, node: str, address: str) -> Connection:
        """A Unix-socket connection with the daemon's arena mapped read-only (enough for gets;
        writable_arena() maps it writable on a first put)."""
        from gcache.server.local import unix_name

        conn = Connection(node, address, self.connect_timeout_s, self.token, unix=unix_name(address))
        try:
            conn.arena, conn.arena_id = self._mapped(conn, self._arenas, False)
        except GCacheError:
            conn.close()
            raise
        return conn

    def writable_arena(self, conn: Connection, deadline: float) -> memoryview:
        """The arena of ``conn``'s daemon mapped read-write, for copying values into reserved slots."""
        view, arena_id = self._mapped(conn, self._rw_arenas, True, deadline)
        if arena_id != conn.arena_id:
            conn.broken = True
            raise ProtocolError(f"{conn.node}: the daemon's arena changed under a connection")
        return view

    def _mapped(self, conn: Connection, cache: dict[str, tuple[str, mmap.mmap, memoryview]], writable: bool,
                deadline: float | None = None) -> tuple[memoryview, str]:
        """The arena mapping of ``conn``'s daemon (cached per node and arena incarnation)."""
        with self._lock:
            cached = cache.get(conn.node)
        if cached is not None and writable and cached[0] == conn.arena_id:
            return cached[2], cached[0]  # the writable mapping of this incarnation: no LMAP needed
        meta, fd = conn.map_arena(deadline or time.monotonic() + self.connect_timeout_s, writable)
        arena_id = str(meta.get("id"))
        if cached is not None and cached[0] == arena_id:
            os.close(fd)
            return cached[2], arena_id
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            mm = mmap.mmap(fd, int(meta["size"]), mmap.MAP_SHARED, prot)
        except (OSError, ValueError, KeyError) as exc:
            conn.broken = True
            raise ConnectionFailed(conn.node, f"cannot map the daemon's arena: {exc}") from None
        finally:
            os.close(fd)
        view = memoryview(mm)
        with self._lock:
            cache[conn.node] = (arena_id, mm, view)
        return view, arena_id

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
