"""Idle connections per daemon, and the mapped arenas of daemons on this host."""

from __future__ import annotations

import mmap
import os
import threading
import time

from gcache.client.config import LocalPath
from gcache.errors import (
    CallTimeout,
    ClientClosed,
    ClientForked,
    ConnectionFailed,
    GCacheError,
    ProtocolError,
)
from gcache.net.address import host_of, is_local_host
from gcache.transport import Connection, Transport, open_connection

LOCAL_RETRY_S = 5.0  # after the local path to a daemon failed, TCP is used this long


def knows_node(node: str, address: str) -> bool:
    """Whether ``node`` is the id of the daemon at ``address`` as the masters know it, so that
    the daemon answering there must say it is ``node`` (gcache.transport.open_connection's
    check_node). A static cluster names each node by its address (Membership.from_addresses)
    and the daemon's own id may be anything: nothing to check then."""
    return node != address


class Pool:
    """Idle connections per node; a checked-out connection belongs to one call at a time.

    With the local path on, a daemon on this host is reached over its Unix socket and its arena
    is mapped once per daemon incarnation (shared by every connection to it).

    A pool belongs to the process that made it: in a child forked from it every connection is
    also the parent's (both could send the same request id on one socket and take each other's
    reply: another key's value, or the other's arena offset), so there it hands out none
    (ClientForked) and, closed, forgets them without touching the sockets."""

    def __init__(self, connect_timeout_s: float, max_idle_per_node: int = 8, token: str | None = None,
                 local: LocalPath = LocalPath.AUTO, transport: Transport = Transport.TCP) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.token = token
        self.local = local
        self.transport = transport
        self._arenas: dict[str, tuple[str, mmap.mmap, memoryview]] = {}  # read-only mappings
        self._rw_arenas: dict[str, tuple[str, mmap.mmap, memoryview]] = {}  # writable ones (puts)
        self._no_local: dict[str, float] = {}  # node -> when the local path last failed
        self.max_idle = max_idle_per_node
        self._idle: dict[str, list[Connection]] = {}
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.closed = False

    def owned(self) -> bool:
        """Whether this is the process that made this pool (not a child forked from it)."""
        return os.getpid() == self._pid

    def check_usable(self) -> None:
        """ClientForked in a process forked from the one that made this pool; ClientClosed once
        it is closed."""
        if not self.owned():
            raise ClientForked(self._pid)
        if self.closed:
            raise ClientClosed()

    def idle(self, node: str, address: str) -> Connection | None:
        """An idle connection to ``node`` that is still good, or None."""
        self.check_usable()
        with self._lock:
            idle = self._idle.get(node)
            while idle:
                conn = idle.pop()
                if conn.address == address and conn.idle_ok():
                    return conn
                conn.close()
        return None

    def is_local(self, node: str, address: str) -> bool:
        """Whether a new connection to ``node`` takes the local path (its daemon is on this
        host, the path is on, and it has not failed lately)."""
        if self.local is LocalPath.OFF or not is_local_host(host_of(address)):
            return False
        failed = self._no_local.get(node)
        return self.local is LocalPath.FORCE or failed is None or time.monotonic() - failed > LOCAL_RETRY_S

    def get(self, node: str, address: str, deadline: float | None = None) -> Connection:
        """A connection to ``node``: an idle one, else a new one, dialled within the connect
        timeout and by ``deadline`` (the call's: a connect never outlasts the call that needs
        it; CallTimeout once it has passed). ClientForked in a forked child."""
        conn = self.idle(node, address)
        if conn is not None:
            return conn
        if self.is_local(node, address):
            try:
                return self._local_connection(node, address, deadline)
            except CallTimeout:
                if self.local is LocalPath.FORCE or self._cut_short(deadline):
                    raise  # the call ran out of time, not the local path: keep it (a reviewer: TCP for 5 s)
                self._no_local[node] = time.monotonic()
            except GCacheError:
                if self.local is LocalPath.FORCE:
                    raise
                self._no_local[node] = time.monotonic()
        return open_connection(node, address, self._connect_budget(node, deadline), self.token, self.transport,
                               check_node=knows_node(node, address))

    def _cut_short(self, deadline: float | None) -> bool:
        """Whether a connect that timed out now was given less than the connect timeout (the
        call's deadline came first)."""
        return deadline is not None and deadline - time.monotonic() < self.connect_timeout_s

    def _connect_budget(self, node: str, deadline: float | None) -> float:
        if deadline is None:
            return self.connect_timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise CallTimeout(node, self.connect_timeout_s)
        return min(self.connect_timeout_s, left)

    def _local_connection(self, node: str, address: str, deadline: float | None = None) -> Connection:
        """A Unix-socket connection with the daemon's arena mapped read-only (enough for gets;
        writable_arena() maps it writable on a first put)."""
        conn = open_connection(node, address, self._connect_budget(node, deadline), self.token, self.transport,
                               local=True, check_node=knows_node(node, address))
        try:
            conn.arena, conn.arena_id = self._mapped(conn, self._arenas, False, deadline)
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
        by = time.monotonic() + self.connect_timeout_s
        meta, fd = conn.map_arena(by if deadline is None else min(by, deadline), writable)
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
        if not self.owned():
            return  # the parent's connection: left as it is
        if conn.broken or conn.pending or self.closed:  # (a call that was running at close)
            conn.close()
            return
        with self._lock:
            idle = self._idle.setdefault(conn.node, [])
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; connections of calls still running are closed as they end,
        and later calls raise ClientClosed. The arena mappings go with the last view of them."""
        with self._lock:
            self.closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
            self._arenas.clear()
            self._rw_arenas.clear()
        if not self.owned():
            return  # a forked child: the sockets are the parent's too (no shutdown, no reset)
        for conn in conns:
            conn.close()
