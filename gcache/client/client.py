"""gcache.Client: ring routing, batched fan-out, zero-copy into caller buffers.

Every operation is a batch. A batch is split by owner (the consistent-hash ring, computed
here; no metadata service on the I/O path); each owner gets one request, all requests are
sent before any reply is read, so the owners work in parallel and the batch costs one round
trip. Values go from the caller's buffers to the socket with sendmsg, and from the socket into
the caller's buffers with recv_into.
"""

from __future__ import annotations

import enum
import select
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gcache.client.buffers import as_view
from gcache.client.connection import Connection, Pool
from gcache.errors import CallTimeout, ConfigError, GCacheError, ProtocolError, ServerError
from gcache.meta.membership import Membership
from gcache.meta.ring import DEFAULT_VNODES, HashRing
from gcache.protocol import Op, Status, namespace_error

KeyLike = str | bytes


class OnNodeError(enum.Enum):
    """What a batch does when an owning node fails: RAISE the typed error after the other
    owners have answered, or report its keys as UNAVAILABLE (gets and exists become misses)."""

    RAISE = "raise"
    MISS = "miss"


@dataclass
class GetResult:
    """Per-key outcome of get_into: ``status[i]`` and, for OK, ``sizes[i]`` bytes written."""

    status: list[Status]
    sizes: list[int]

    @property
    def hits(self) -> int:
        return sum(1 for s in self.status if s is Status.OK)

    def ok(self) -> list[bool]:
        return [s is Status.OK for s in self.status]


def _key_bytes(key: KeyLike) -> bytes:
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode()
    raise TypeError(f"keys are str or bytes, got {type(key).__name__}")


class Client:
    def __init__(
        self,
        nodes: Iterable[str] | Membership,
        *,
        namespace: str = "default",
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        on_node_error: OnNodeError = OnNodeError.RAISE,
        vnodes: int = DEFAULT_VNODES,
        max_idle_per_node: int = 8,
    ) -> None:
        err = namespace_error(namespace)
        if err:
            raise ConfigError(err)
        if not timeout_s > 0 or not connect_timeout_s > 0:
            raise ConfigError("timeouts must be > 0 seconds")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.on_node_error = OnNodeError(on_node_error)
        self._vnodes = vnodes
        self._pool = Pool(connect_timeout_s, max_idle_per_node)
        self._lock = threading.Lock()
        membership = nodes if isinstance(nodes, Membership) else Membership.from_addresses(nodes)
        self.update_membership(membership)

    def __repr__(self) -> str:
        return f"Client(namespace={self.namespace!r}, epoch={self.membership.epoch}, nodes={list(self._addr)})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.close()

    # -- membership -------------------------------------------------------------------------
    def update_membership(self, membership: Membership) -> None:
        """Swap in a new membership; calls already running finish on the old one."""
        owners = membership.owners()
        if not owners:
            raise ConfigError(f"membership epoch {membership.epoch} has no node that owns keys")
        ring = HashRing({nid: n.weight for nid, n in owners.items()}, self._vnodes)
        with self._lock:
            self.membership = membership
            self._ring = ring
            self._addr = {nid: n.address for nid, n in owners.items()}

    def owners(self, keys: Sequence[KeyLike], namespace: str | None = None) -> list[str]:
        """Node id that owns each key."""
        return self._ring.owners(namespace or self.namespace, [_key_bytes(k) for k in keys])

    # -- batch operations -------------------------------------------------------------------
    def put(self, keys: Sequence[KeyLike], values: Sequence[Any], *, ttl_s: float = 0.0,
            namespace: str | None = None) -> list[Status]:
        """Store values (bytes-like, numpy arrays, CPU tensors); per-key Status."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        if ttl_s < 0:
            raise ValueError("ttl_s must be >= 0")
        views = [as_view(v) for v in values]
        status = [Status.ERROR] * len(keys)

        def build(idxs: list[int], kb: list[bytes]) -> tuple[dict, list[memoryview]]:
            meta = {"ns": ns, "keys": kb, "sizes": [len(views[i]) for i in idxs]}
            if ttl_s:
                meta["ttl"] = ttl_s
            return meta, [views[i] for i in idxs]

        def finish(idxs: list[int], meta: dict, plen: int, conn: Connection, deadline: float) -> None:
            for i, st in zip(idxs, _statuses(meta, len(idxs), conn.node)):
                status[i] = st

        ns = namespace or self.namespace
        self._fanout(Op.PUT, ns, keys, build, finish, status)
        return status

    def get_into(self, keys: Sequence[KeyLike], buffers: Sequence[Any], *,
                 namespace: str | None = None) -> GetResult:
        """Read values straight into the caller's buffers (each at least the value's size)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        views = [as_view(b, writable=True) for b in buffers]
        return self._get(keys, views, namespace or self.namespace)[0]

    def get(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[bytearray | None]:
        """Read values into new bytearrays (convenience; get_into avoids the allocation)."""
        res, bufs = self._get(keys, None, namespace or self.namespace)
        return [buf if st is Status.OK else None for st, buf in zip(res.status, bufs)]

    def exists(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[bool]:
        return [s is Status.OK for s in self._keys_only(Op.EXISTS, keys, namespace)]

    def delete(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[bool]:
        """True for each key that existed."""
        return [s is Status.OK for s in self._keys_only(Op.DELETE, keys, namespace)]

    # -- single-key forms (batches of one) --------------------------------------------------
    def put_one(self, key: KeyLike, value: Any, *, ttl_s: float = 0.0, namespace: str | None = None) -> Status:
        return self.put([key], [value], ttl_s=ttl_s, namespace=namespace)[0]

    def get_one(self, key: KeyLike, *, namespace: str | None = None) -> bytearray | None:
        return self.get([key], namespace=namespace)[0]

    def exists_one(self, key: KeyLike, *, namespace: str | None = None) -> bool:
        return self.exists([key], namespace=namespace)[0]

    # -- per-node calls ---------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, Any]]:
        """STATS of every owning node: {node_id: stats} (a failed node maps to {"error": ...})."""
        return self._each_node(Op.STATS, lambda meta: meta.get("stats", {}))

    def ping(self) -> dict[str, dict[str, Any]]:
        """Round-trip time of every owning node: {node_id: {"rtt_ms": float}} or {"error": ...}."""
        out: dict[str, dict[str, Any]] = {}
        for node in list(self._addr):
            t0 = time.perf_counter()
            res = self._each_node(Op.PING, lambda meta: {}, only=node)[node]
            if "error" not in res:
                res["rtt_ms"] = (time.perf_counter() - t0) * 1e3
            out[node] = res
        return out

    # -- internals --------------------------------------------------------------------------
    def _get(self, keys: Sequence[KeyLike], views: list[memoryview] | None,
             ns: str) -> tuple[GetResult, list[Any]]:
        """Into ``views``, or (views None) into new bytearrays; returns the result and buffers."""
        n = len(keys)
        status = [Status.ERROR] * n
        sizes = [0] * n
        bufs: list[Any] = list(views) if views is not None else [None] * n

        def build(idxs: list[int], kb: list[bytes]) -> tuple[dict, list]:
            return {"ns": ns, "keys": kb}, []

        def finish(idxs: list[int], meta: dict, plen: int, conn: Connection, deadline: float) -> None:
            sts = _statuses(meta, len(idxs), conn.node)
            szs = meta.get("sz")
            if not isinstance(szs, list) or len(szs) != len(idxs):
                conn.broken = True
                raise ProtocolError(f"{conn.node}: GET reply without one size per key")
            if sum(sz for st, sz in zip(sts, szs) if st is Status.OK) != plen:
                conn.broken = True
                raise ProtocolError(f"{conn.node}: GET reply sizes do not add up to its payload")
            for i, st, sz in zip(idxs, sts, szs):
                if st is not Status.OK:
                    status[i] = st
                    continue
                if views is None:
                    bufs[i] = bytearray(sz)
                    dest = memoryview(bufs[i])
                else:
                    dest = views[i]
                if len(dest) < sz:
                    conn.discard(sz, deadline)
                    status[i] = Status.BUFFER_TOO_SMALL
                    sizes[i] = sz
                    continue
                conn.recv_into(dest[:sz], deadline)
                status[i] = Status.OK
                sizes[i] = sz

        self._fanout(Op.GET, ns, keys, build, finish, status)
        return GetResult(status, sizes), bufs

    def _keys_only(self, op: Op, keys: Sequence[KeyLike], namespace: str | None) -> list[Status]:
        ns = namespace or self.namespace
        status = [Status.ERROR] * len(keys)

        def build(idxs: list[int], kb: list[bytes]) -> tuple[dict, list]:
            return {"ns": ns, "keys": kb}, []

        def finish(idxs: list[int], meta: dict, plen: int, conn: Connection, deadline: float) -> None:
            for i, st in zip(idxs, _statuses(meta, len(idxs), conn.node)):
                status[i] = st

        self._fanout(op, ns, keys, build, finish, status)
        return status

    def _fanout(self, op: Op, ns: str, keys: Sequence[KeyLike],
                build: Callable[[list[int], list[bytes]], tuple[dict, list]],
                finish: Callable[[list[int], dict, int, Connection, float], None],
                status: list[Status]) -> None:
        """Send one request per owner, then read the replies; failed owners' keys get
        UNAVAILABLE, and with OnNodeError.RAISE the first failure is raised at the end."""
        err = namespace_error(ns)
        if err:
            raise ValueError(err)
        if not keys:
            return
        kbytes = [_key_bytes(k) for k in keys]
        with self._lock:
            ring, addr = self._ring, self._addr
        groups: dict[str, list[int]] = {}
        for i, owner in enumerate(ring.owners(ns, kbytes)):
            groups.setdefault(owner, []).append(i)
        deadline = time.monotonic() + self.timeout_s
        failures: list[GCacheError] = []
        sending: dict[int, tuple[list[int], Connection]] = {}
        for node, idxs in groups.items():
            conn = None
            try:
                conn = self._pool.get(node, addr[node])
                meta, payload = build(idxs, [kbytes[i] for i in idxs])
                conn.prepare(op, meta, payload, self.timeout_s)
                sending[conn.sock.fileno()] = (idxs, conn)
            except GCacheError as exc:
                self._failed(idxs, conn, exc, status, failures)
        # Interleave the sends, so every owner receives at once and a stalled owner cannot hold
        # up the others; then read each reply as soon as its owner has started answering.
        receiving = self._poll_loop(sending, select.POLLOUT, deadline, status, failures,
                                    lambda idxs, conn: conn.send_some(deadline))
        self._poll_loop(receiving, select.POLLIN, deadline, status, failures,
                        lambda idxs, conn: self._finish(idxs, conn, finish, deadline))
        if failures and self.on_node_error is OnNodeError.RAISE:
            raise failures[0]

    def _finish(self, idxs: list[int], conn: Connection, finish: Callable, deadline: float) -> bool:
        meta, plen = conn.recv_reply(deadline)
        finish(idxs, meta, plen, conn, deadline)
        self._pool.put(conn)
        return True

    def _poll_loop(self, conns: dict[int, tuple[list[int], Connection]], event: int, deadline: float,
                   status: list[Status], failures: list[GCacheError],
                   step: Callable[[list[int], Connection], bool]) -> dict[int, tuple[list[int], Connection]]:
        """Run ``step`` on each connection whenever it is ready for ``event`` until it returns
        True; returns the finished ones. Connections still unfinished at the deadline fail."""
        done: dict[int, tuple[list[int], Connection]] = {}
        poller = select.poll()
        for fd in conns:
            poller.register(fd, event)
        pending = dict(conns)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for fd, _ev in poller.poll(remaining * 1000):
                idxs, conn = pending[fd]
                try:
                    finished = step(idxs, conn)
                except GCacheError as exc:
                    finished = False
                    self._failed(idxs, conn, exc, status, failures)
                    del pending[fd]
                    poller.unregister(fd)
                    continue
                if finished:
                    done[fd] = pending.pop(fd)
                    poller.unregister(fd)
        for idxs, conn in pending.values():
            self._failed(idxs, conn, CallTimeout(conn.node, self.timeout_s), status, failures)
        return done

    def _failed(self, idxs: list[int], conn: Connection | None, exc: GCacheError,
                status: list[Status], failures: list[GCacheError]) -> None:
        for i in idxs:
            status[i] = Status.UNAVAILABLE
        failures.append(exc)
        if conn is not None:
            if isinstance(exc, ServerError) and not conn.broken:
                self._pool.put(conn)  # a refusal leaves the connection in sync
            else:
                conn.close()

    def _each_node(self, op: Op, pick: Callable[[dict], dict], only: str | None = None) -> dict[str, dict]:
        out: dict[str, dict] = {}
        deadline = time.monotonic() + self.timeout_s
        for node, address in list(self._addr.items()):
            if only is not None and node != only:
                continue
            conn = None
            try:
                conn = self._pool.get(node, address)
                conn.send(op, {}, [], deadline, self.timeout_s)
                meta, _ = conn.recv_reply(deadline)
                out[node] = dict(pick(meta))
                self._pool.put(conn)
            except GCacheError as exc:
                out[node] = {"error": str(exc)}
                if conn is not None:
                    conn.close()
        return out


def _statuses(meta: dict, n: int, node: str) -> list[Status]:
    st = meta.get("st")
    if not isinstance(st, list) or len(st) != n:
        raise ProtocolError(f"{node}: reply without one status per key")
    try:
        return [Status(s) for s in st]
    except ValueError:
        raise ProtocolError(f"{node}: unknown status in reply") from None
