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
from typing import Any, Self

import numpy as np

from gcache.client.buffers import as_view
from gcache.client.connection import Connection, Pool
from gcache.client.routing import MembershipWatcher, RoutingView, rate_limited
from gcache.client.staging import StagingPool, is_device_tensor
from gcache.errors import CallTimeout, ConfigError, ConnectionFailed, GCacheError, ProtocolError, ServerError
from gcache.meta.master_client import SCHEME, MasterClient
from gcache.meta.membership import Membership
from gcache.meta.ring import HashRing
from gcache.meta.rpc import load_token
from gcache.protocol import Op, Status, namespace_error
from gcache.tier.valuemeta import ValueMeta
from gcache.transport import Transport

KeyLike = str | bytes
LEASE_MARGIN_S = 0.05  # a local read finished this long before its lease deadline is valid
LOCAL_OPS = {Op.GET: Op.LGET, Op.PUT: Op.LALLOC}  # what a batch sends over the local path


class LocalPath(enum.Enum):
    """The shared-memory path to a daemon on this host: AUTO uses it when the daemon offers it
    (else TCP), OFF never, FORCE always (failing when it is not available)."""

    AUTO = "auto"
    OFF = "off"
    FORCE = "force"


class OnNodeError(enum.Enum):
    """What a batch does when an owning node fails: RAISE the typed error after the other
    owners have answered, or report its keys as UNAVAILABLE (gets and exists become misses)."""

    RAISE = "raise"
    MISS = "miss"


@dataclass
class GetResult:
    """Per-key outcome of get_into: ``status[i]`` and, for OK, ``sizes[i]`` bytes written;
    ``meta[i]``: the hit's value-metadata record, when asked for (``with_meta=True``)."""

    status: list[Status]
    sizes: list[int]
    meta: list[ValueMeta | None] | None = None

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
        nodes: str | Iterable[str] | Membership,
        *,
        namespace: str = "default",
        timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        on_node_error: OnNodeError = OnNodeError.RAISE,
        token: str | None = None,
        local: LocalPath = LocalPath.AUTO,
        max_idle_per_node: int = 8,
        split_bytes: int = 4 << 20,
        split_keys: int = 64,
        transport: Transport = Transport.TCP,
    ) -> None:
        """``nodes``: ``"gcache://M1:PORT,M2:PORT"`` (the master group: membership is fetched and
        followed), a list of daemon HOST:PORT (a static cluster), or a Membership. ``token``:
        the cluster token (default: gcache.env.resolve_token(), i.e. $GCACHE_TOKEN_FILE, else
        $GCACHE_TOKEN), sent to masters and daemons. ``local``: use
        the shared-memory path to daemons on this host (AUTO: when reachable, else TCP).
        ``transport``: TCP, or UCX (daemons run with ``--ucx``; UCX brings its own shared memory,
        so the local path is off; the UCX_* environment picks UCX's transports)."""
        err = namespace_error(namespace)
        if err:
            raise ConfigError(err)
        if not timeout_s > 0 or not connect_timeout_s > 0:
            raise ConfigError("timeouts must be > 0 seconds")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.on_node_error = OnNodeError(on_node_error)
        self.token = token if token is not None else load_token(None)
        if split_bytes < 1 or split_keys < 1:
            raise ConfigError("split_bytes and split_keys must be >= 1")
        self.split_bytes, self.split_keys = split_bytes, split_keys
        self.local = LocalPath(local)
        self.transport = Transport(transport)
        if self.transport is Transport.UCX and self.local is LocalPath.FORCE:
            raise ConfigError("local=FORCE needs transport=TCP (UCX brings its own shared memory)")
        if self.transport is Transport.UCX:  # load ucxx now (~1 s), not inside the first call's deadline
            from gcache.transport import ucx

            ok, why = ucx.available()
            if not ok:
                raise ConfigError(f"transport=UCX: {why}")
        self._pool = Pool(connect_timeout_s, max_idle_per_node, self.token,
                          self.local.value if self.transport is Transport.TCP else "off", self.transport.value)
        self._lock = threading.Lock()
        self._watcher: MembershipWatcher | None = None
        self._staging: StagingPool | None = None
        self._may_refresh = rate_limited(0.05)
        if isinstance(nodes, str) and nodes.startswith(SCHEME):
            # one round trip: the watch stream's first message is the whole membership
            masters = MasterClient(nodes, self.token, timeout_s=connect_timeout_s * 2)
            self._watcher = MembershipWatcher(masters, self.update_membership).start()
            if not self._watcher.wait_first(self._watcher.attempt_timeout_s * len(masters.addresses) + 1.0):
                err = self._watcher.error
                self._watcher.stop()
                self._watcher = None
                self._pool.close()
                if isinstance(err, GCacheError):
                    raise err
                raise ConfigError(f"no master at {nodes} answered")
        else:
            membership = nodes if isinstance(nodes, Membership) else Membership.from_addresses(
                [nodes] if isinstance(nodes, str) else nodes)
            self.update_membership(membership)

    @property
    def membership(self) -> Membership:
        return self._view.membership

    def __repr__(self) -> str:
        return f"Client(namespace={self.namespace!r}, epoch={self._view.epoch}, nodes={list(self._view.addr)})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._pool.close()

    # -- membership -------------------------------------------------------------------------
    def update_membership(self, membership: Membership) -> None:
        """Swap in a newer membership; calls already running finish on the old one."""
        current = getattr(self, "_view", None)
        if current is not None and membership.epoch < current.epoch:
            return
        view = RoutingView.build(membership)
        with self._lock:
            self._view = view

    def refresh_membership(self) -> bool:
        """Ask the masters for the membership now; True if it changed."""
        if self._watcher is None:
            return False
        before = self._view.epoch
        m = self._watcher.refresh()
        if m is not None:
            self.update_membership(m)
        return self._view.epoch != before

    def owners(self, keys: Sequence[KeyLike], namespace: str | None = None) -> list[str]:
        """Node id that owns each key."""
        return self._view.ring.owners(namespace or self.namespace, [_key_bytes(k) for k in keys])

    # -- batch operations -------------------------------------------------------------------
    def put(self, keys: Sequence[KeyLike], values: Sequence[Any], *, ttl_s: float | Sequence[float] = 0.0,
            namespace: str | None = None, pool: str | None = None, pos: Sequence[int] | None = None,
            tail: Sequence[int] | None = None, fmt: int | Sequence[int] = 0, handover: bool = False) -> list[Status]:
        """Store values (bytes-like, numpy arrays, CPU or GPU tensors); per-key Status.

        A value may also be a list/tuple of buffers, stored as their concatenation (sent
        scatter-gather, not copied). Each value carries a metadata record (gcache.tier.valuemeta)
        that the daemons keep with it in RAM, on disk and through handovers: ``ttl_s`` (one for
        all keys or one per key), ``pool`` (a daemon pool: own byte budget, prefix-aware
        eviction), ``pos`` (each key's position in its page chain), ``tail`` (1: a restore
        point's trailing-window page) and ``fmt`` (your format tag, an unsigned 32-bit int;
        one for all or one per key). See gcache.tier.pools.
        ``handover`` is for daemons pushing keys to their new owner: each is stored only where no
        client has written or deleted it meanwhile (gcache.server.touchlog)."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        n = len(keys)
        ttls = _per_key("ttl_s", ttl_s, n, float)
        fmts = _per_key("fmt", fmt, n, int)
        if any(t < 0 for t in (ttls if isinstance(ttls, list) else [ttls])):
            raise ValueError("ttl_s must be >= 0")
        if any(not 0 <= f < 1 << 32 for f in (fmts if isinstance(fmts, list) else [fmts])):
            raise ValueError("fmt must be an unsigned 32-bit int")
        pos = _per_key("pos", list(pos), n, int) if pos is not None else None
        tail = _per_key("tail", list(tail), n, int) if tail is not None else None
        if any(is_device_tensor(v) for v in values):
            return self.staging().put(self, keys, values, ttl_s=ttls, namespace=namespace, pool=pool, pos=pos,
                                      tail=tail, fmt=fmts)
        views = [_parts(v) for v in values]
        status = [Status.ERROR] * n

        def build(idxs: list[int], kb: list[bytes]) -> tuple[dict, list[memoryview]]:
            meta: dict[str, Any] = {"ns": ns, "keys": kb, "sizes": [sum(map(len, views[i])) for i in idxs]}
            for field, per_key in (("ttl", ttls), ("fmt", fmts), ("pos", pos), ("tail", tail)):
                if isinstance(per_key, list):
                    meta[field] = [per_key[i] for i in idxs]
                elif per_key:
                    meta[field] = per_key
            if handover:
                meta["ho"] = 1
            if pool is not None:
                meta["pool"] = pool
            return meta, [part for i in idxs for part in views[i]]

        def finish(idxs: list[int], meta: dict, plen: int, conn: Connection, deadline: float) -> None:
            for i, st in zip(idxs, _statuses(meta, len(idxs), conn.node)):
                status[i] = st

        def local(idxs: list[int], conn: Connection, reply: dict, plen: int, deadline: float) -> None:
            """The daemon reserved slots in its arena (LALLOC): copy the values in, commit."""
            arena = self._pool.writable_arena(conn, deadline)
            reserved = _statuses(reply, len(idxs), conn.node)
            for i, st, off in zip(idxs, reserved, reply.get("off") or []):
                if st is Status.OK:
                    for part in views[i]:
                        _memcpy(arena[off:off + len(part)], part)
                        off += len(part)
            done = _statuses(conn.call(Op.LCOMMIT, {"ls": reply["ls"]}, deadline), len(idxs), conn.node)
            for i, st0, st in zip(idxs, reserved, done):
                status[i] = st if st0 is Status.OK else st0

        ns = namespace or self.namespace
        self._fanout(Op.PUT, ns, keys, build, finish, status, local=local,
                     sizes=[sum(map(len, v)) for v in views])
        return status

    def get_into(self, keys: Sequence[KeyLike], buffers: Sequence[Any], *,
                 namespace: str | None = None, with_meta: bool = False) -> GetResult:
        """Read values straight into the caller's buffers (each at least the value's size). A
        buffer may be a list/tuple of buffers, filled in order (scatter). ``with_meta``: also
        return each hit's value-metadata record (GetResult.meta; not for device tensors)."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if any(is_device_tensor(b) for b in buffers):
            st = self.staging().get_into(self, keys, buffers, namespace=namespace)
            return GetResult(st, [self.staging().copier.nbytes(b) if s is Status.OK else 0
                                  for s, b in zip(st, buffers)])
        views = [_parts(b, True) if isinstance(b, (list, tuple)) else as_view(b, writable=True) for b in buffers]
        return self._get(keys, views, namespace or self.namespace, with_meta)[0]

    def get(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[bytearray | None]:
        """Read values into new bytearrays (convenience; get_into avoids the allocation)."""
        res, bufs = self._get(keys, None, namespace or self.namespace)
        return [buf if st is Status.OK else None for st, buf in zip(res.status, bufs)]

    def exists(self, keys: Sequence[KeyLike], *, namespace: str | None = None,
               tail: Sequence[int] | None = None) -> list[bool]:
        """Whether each key is stored (a hit refreshes its recency). ``tail`` re-marks existing
        pooled pages as restore-point (1) or interior (0) pages."""
        if tail is not None and len(tail) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(tail)} tail values")
        per_key = {"tail": [int(t) for t in tail]} if tail is not None else None
        return [s is Status.OK for s in self._keys_only(Op.EXISTS, keys, namespace, per_key)]

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
        for node in list(self._view.addr):
            t0 = time.perf_counter()
            res = self._each_node(Op.PING, lambda meta: {}, only=node)[node]
            if "error" not in res:
                res["rtt_ms"] = (time.perf_counter() - t0) * 1e3
            out[node] = res
        return out

    # -- internals --------------------------------------------------------------------------
    def _get(self, keys: Sequence[KeyLike], views: list[memoryview] | None,
             ns: str, with_meta: bool = False) -> tuple[GetResult, list[Any]]:
        """Into ``views``, or (views None) into new bytearrays; returns the result and buffers."""
        n = len(keys)
        status = [Status.ERROR] * n
        sizes = [0] * n
        bufs: list[Any] = list(views) if views is not None else [None] * n
        metas: list[ValueMeta | None] | None = [None] * n if with_meta else None

        def build(idxs: list[int], kb: list[bytes]) -> tuple[dict, list]:
            return ({"ns": ns, "keys": kb, "vm": 1} if with_meta else {"ns": ns, "keys": kb}), []

        def take_meta(idxs: list[int], reply: dict) -> None:
            vm = reply.get("vm")
            if metas is not None and isinstance(vm, list) and len(vm) == len(idxs):
                for i, v in zip(idxs, vm):
                    metas[i] = ValueMeta.from_wire(v)

        def dest_for(i: int, size: int) -> memoryview | list[memoryview]:
            """Where key i's value goes: the caller's buffer, or a new bytearray."""
            if views is None:
                bufs[i] = bytearray(size)
                return memoryview(bufs[i])
            return views[i]

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
                dest = dest_for(i, sz)
                if _nbytes(dest) < sz:
                    conn.discard(sz, deadline)
                    status[i] = Status.BUFFER_TOO_SMALL
                    sizes[i] = sz
                    continue
                _recv_parts(conn, dest, sz, deadline)
                status[i] = Status.OK
                sizes[i] = sz
            take_meta(idxs, meta)

        def local(idxs: list[int], conn: Connection, reply: dict, plen: int, deadline: float) -> None:
            """The daemon pinned the values under a lease (LGET): copy them out of the mapped
            arena, release the lease; one that expired meanwhile turns its keys into misses."""
            arena = conn.arena
            assert arena is not None
            sts = _statuses(reply, len(idxs), conn.node)
            szs, offs = reply.get("sz"), reply.get("off")
            if not isinstance(szs, list) or not isinstance(offs, list) or len(szs) != len(idxs) != len(offs):
                conn.broken = True
                raise ProtocolError(f"{conn.node}: LGET reply without one size and offset per key")
            copied = []
            for i, st, sz, off in zip(idxs, sts, szs, offs):
                if st is not Status.OK:
                    status[i] = st
                    continue
                dest = dest_for(i, sz)
                if _nbytes(dest) < sz:
                    if off < 0:
                        conn.discard(sz, deadline)
                    status[i], sizes[i] = Status.BUFFER_TOO_SMALL, sz
                    continue
                if off < 0:  # sent inline (not in the arena)
                    _recv_parts(conn, dest, sz, deadline)
                else:
                    for d, src in _copy_pairs(arena[off:off + sz], dest):
                        _memcpy(d, src)
                    copied.append(i)
                status[i], sizes[i] = Status.OK, sz
            take_meta(idxs, reply)
            if reply.get("ls"):
                dl = reply.get("dl")
                if isinstance(dl, float) and time.monotonic() < dl - LEASE_MARGIN_S:
                    # finished well inside the lease: no slot can have been reused, no need to ask
                    conn.send_oneway(Op.LDONE, {"ls": [reply["ls"]]}, deadline)
                    return
                held = conn.call(Op.LDONE, {"ls": [reply["ls"]]}, deadline).get("ok")
                if held != [True]:
                    for i in copied:  # the lease expired during the copy: the bytes may be torn
                        status[i], sizes[i] = Status.NOT_FOUND, 0

        self._fanout(Op.GET, ns, keys, build, finish, status, fallback=True, local=local,
                     sizes=[_nbytes(v) for v in views] if views is not None else None)
        if metas is not None:
            metas = [m if st is Status.OK else None for m, st in zip(metas, status)]
        return GetResult(status, sizes, metas), bufs

    def _keys_only(self, op: Op, keys: Sequence[KeyLike], namespace: str | None,
                   per_key: dict[str, list] | None = None) -> list[Status]:
        ns = namespace or self.namespace
        status = [Status.ERROR] * len(keys)

        def build(idxs: list[int], kb: list[bytes]) -> tuple[dict, list]:
            meta: dict[str, Any] = {"ns": ns, "keys": kb}
            for field, values in (per_key or {}).items():
                meta[field] = [values[i] for i in idxs]
            return meta, []

        def finish(idxs: list[int], meta: dict, plen: int, conn: Connection, deadline: float) -> None:
            for i, st in zip(idxs, _statuses(meta, len(idxs), conn.node)):
                status[i] = st

        self._fanout(op, ns, keys, build, finish, status, fallback=op is Op.EXISTS)
        return status

    def _fanout(self, op: Op, ns: str, keys: Sequence[KeyLike],
                build: Callable[[list[int], list[bytes]], tuple[dict, list]],
                finish: Callable[[list[int], dict, int, Connection, float], None],
                status: list[Status], fallback: bool = False, local: Callable | None = None,
                sizes: Sequence[int] | None = None) -> None:
        """Run a batch: one request per owner, all owners at once. Keys a node refuses as
        NOT_OWNER (our membership was stale) are retried once on the refreshed membership; with
        ``fallback``, misses during a handover are looked up on the key's previous owner. Failed
        owners' keys get UNAVAILABLE; with OnNodeError.RAISE the first failure is raised last."""
        err = namespace_error(ns)
        if err:
            raise ValueError(err)
        if not keys:
            return
        kbytes = [_key_bytes(k) for k in keys]
        failures: list[GCacheError] = []
        final: set[int] = set()  # misses the owner says are final: no fallback (gcache.server.touchlog)
        view = self._view
        deadline = time.monotonic() + self.timeout_s
        seen = self._round(op, ns, kbytes, range(len(kbytes)), view.ring, view.addr, view.epoch, False,
                           build, finish, status, failures, deadline, local, sizes, final)
        if seen > view.epoch and self._may_refresh():
            self.refresh_membership()
        retry = [i for i, st in enumerate(status) if st is Status.NOT_OWNER]
        if retry and (self._view.epoch > view.epoch or self.refresh_membership()):
            view = self._view
            self._round(op, ns, kbytes, retry, view.ring, view.addr, view.epoch, False,
                        build, finish, status, failures, deadline, local, sizes, final)
        if fallback and view.prev_ring is not None and view.prev_addr:
            misses = [i for i, st in enumerate(status) if st is Status.NOT_FOUND and i not in final]
            if misses:
                now = view.ring.owners(ns, [kbytes[i] for i in misses])
                before = view.prev_ring.owners(ns, [kbytes[i] for i in misses])
                moved = [i for i, a, b in zip(misses, now, before) if a != b and b in view.prev_addr]
                self._round(op, ns, kbytes, moved, view.prev_ring, view.prev_addr, view.epoch, True,
                            build, finish, status, failures, deadline, local, sizes)
        if failures and self.on_node_error is OnNodeError.RAISE:
            raise failures[0]

    def _round(self, op: Op, ns: str, kbytes: list[bytes], which: Sequence[int], ring: HashRing,
               addr: dict[str, str], epoch: int, fallback: bool,
               build: Callable[[list[int], list[bytes]], tuple[dict, list]],
               finish: Callable[[list[int], dict, int, Connection, float], None],
               status: list[Status], failures: list[GCacheError], deadline: float,
               local: Callable | None = None, sizes: Sequence[int] | None = None,
               final: set[int] | None = None) -> int:
        """One parallel round over the owners (by ``ring``) of keys ``which``; returns the newest
        epoch a reply carried. Owners reached over the local path get LGET/LALLOC instead, and
        ``local`` copies through the mapped arena when their reply comes in."""
        if not which:
            return 0
        by_node: dict[str, list[int]] = {}
        for i, owner in zip(which, ring.owners(ns, [kbytes[i] for i in which])):
            by_node.setdefault(owner, []).append(i)
        # A large batch for one owner goes out as several requests on several connections, all
        # in flight at once, so one caller keeps the owner's threads and the wire busy.
        groups = [(node, chunk) for node, idxs in by_node.items() for chunk in self._split(idxs, sizes)]
        epochs = [0]
        sync_jobs: dict[int, tuple[list[int], Connection]] = {}  # not pollable (UCX): posted now, read below
        sending: dict[int, tuple[list[int], Connection]] = {}

        def request(idxs: list[int], conn: Connection) -> tuple[int, dict, list]:
            meta, payload = build(idxs, [kbytes[i] for i in idxs])
            if epoch:
                meta["ep"] = epoch
            if fallback:
                meta["fb"] = 1
            if conn.arena is not None and local is not None:  # the local path: slots, not payload
                return LOCAL_OPS[op], meta, []
            return op, meta, payload

        late: list[tuple[str, list[int]]] = []  # owners without an idle connection
        for node, idxs in groups:
            conn = None
            try:
                if node not in addr:
                    raise ConnectionFailed(node, "no address in the current membership")
                conn = self._pool.idle(node, addr[node])
                if conn is None:
                    late.append((node, idxs))
                    continue
                req_op, meta, payload = request(idxs, conn)
                if not getattr(conn.sock, "pollable", True):
                    conn.prepare(req_op, meta, payload, self.timeout_s)
                    conn.send_some(deadline)  # posts the whole frame; completed when the reply is read
                    sync_jobs[id(conn.sock)] = (idxs, conn)
                    continue
                conn.prepare(req_op, meta, payload, self.timeout_s)
                sending[conn.sock.fileno()] = (idxs, conn)
            except GCacheError as exc:
                self._failed(idxs, conn, exc, status, failures)

        def receive(idxs: list[int], conn: Connection) -> bool:
            meta, plen = conn.recv_reply(deadline)
            ep = meta.get("ep")
            if isinstance(ep, int):
                epochs.append(ep)
            tomb = meta.get("tomb")
            if final is not None and isinstance(tomb, list):
                final.update(idxs[j] for j in tomb if isinstance(j, int) and 0 <= j < len(idxs))
            if conn.arena is not None and local is not None:
                local(idxs, conn, meta, plen, deadline)  # copy through the mapped arena
            else:
                finish(idxs, meta, plen, conn, deadline)
            self._pool.put(conn)
            return True

        def connect_and_call(node: str, idxs: list[int]) -> None:
            """A new connection is opened in a thread of its own: an owner that does not answer
            costs only its own keys the connect timeout, not the whole batch."""
            conn = None
            try:
                conn = self._pool.get(node, addr[node])
                req_op, meta, payload = request(idxs, conn)
                conn.send(req_op, meta, payload, deadline, self.timeout_s)
                receive(idxs, conn)
            except GCacheError as exc:
                self._failed(idxs, conn, exc, status, failures)

        threads = []
        if len(late) == 1 and not sending and not sync_jobs:
            connect_and_call(*late[0])
        else:
            threads = [threading.Thread(target=connect_and_call, args=g, daemon=True) for g in late]
            for t in threads:
                t.start()
        # Interleave the sends, so every owner receives at once and a stalled owner cannot hold
        # up the others; then read each reply as soon as its owner has started answering.
        receiving = self._poll_loop(sending, select.POLLOUT, deadline, status, failures,
                                    lambda idxs, conn: conn.send_some(deadline))
        while sync_jobs:  # read each reply as it arrives, so a stalled owner holds up no other
            socks = [conn.sock for _idxs, conn in sync_jobs.values()]
            ready = type(socks[0]).wait_readable(socks, deadline)
            for sock in ready:
                idxs, conn = sync_jobs.pop(id(sock))
                try:
                    receive(idxs, conn)
                except GCacheError as exc:
                    self._failed(idxs, conn, exc, status, failures)
            if not ready:
                for idxs, conn in sync_jobs.values():
                    self._failed(idxs, conn, CallTimeout(conn.node, self.timeout_s), status, failures)
                break
        self._poll_loop(receiving, select.POLLIN, deadline, status, failures, receive)
        for t in threads:
            t.join()
        return max(epochs)

    def staging(self) -> StagingPool:
        """The pinned staging pool that carries device tensors over host transports."""
        with self._lock:
            if self._staging is None:
                self._staging = StagingPool()
            return self._staging

    def _split(self, idxs: list[int], sizes: Sequence[int] | None) -> list[list[int]]:
        """Cut one owner's keys into requests of at most ``split_bytes`` (when the value sizes
        are known, as for puts) or ``split_keys`` keys."""
        if sizes is None:
            n = self.split_keys
            return [idxs[i:i + n] for i in range(0, len(idxs), n)]
        out: list[list[int]] = [[]]
        total = 0
        for i in idxs:
            if out[-1] and total + sizes[i] > self.split_bytes:
                out.append([])
                total = 0
            out[-1].append(i)
            total += sizes[i]
        return out

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
        for node, address in list(self._view.addr.items()):
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


def _per_key(name: str, v: Any, n: int, kind: type) -> Any:
    """A per-key argument given once for all keys (returned as is) or as one value per key (as
    a list of ``kind``)."""
    if isinstance(v, (int, float)):
        return kind(v)
    out = [kind(x) for x in v]
    if len(out) != n:
        raise ValueError(f"{n} keys but {len(out)} {name} values")
    return out


def _statuses(meta: dict, n: int, node: str) -> list[Status]:
    st = meta.get("st")
    if not isinstance(st, list) or len(st) != n:
        raise ProtocolError(f"{node}: reply without one status per key")
    try:
        return [Status(s) for s in st]
    except ValueError:
        raise ProtocolError(f"{node}: unknown status in reply") from None


def _parts(value: Any, writable: bool = False) -> list[memoryview]:
    """A value as a list of flat byte views: one, or one per buffer of a list/tuple."""
    if isinstance(value, (list, tuple)):
        return [as_view(v, writable=writable) for v in value]
    return [as_view(value, writable=writable)]


def _memcpy(dest: memoryview, src: memoryview) -> None:
    """One copy; numpy releases the GIL for it, so local copies can run in parallel."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _copy_pairs(src: memoryview, dest: memoryview | list[memoryview]) -> list[tuple[memoryview, memoryview]]:
    """The (dest, src) copies that put ``src`` into one view or, in order, into several."""
    if not isinstance(dest, list):
        return [(dest[: len(src)], src)]
    out, pos = [], 0
    for part in dest:
        n = min(len(part), len(src) - pos)
        if n <= 0:
            break
        out.append((part[:n], src[pos:pos + n]))
        pos += n
    return out


def _nbytes(dest: memoryview | list[memoryview]) -> int:
    return sum(map(len, dest)) if isinstance(dest, list) else len(dest)


def _recv_parts(conn: Connection, dest: memoryview | list[memoryview], size: int, deadline: float) -> None:
    """Receive ``size`` bytes into one view or, in order, into several."""
    if not isinstance(dest, list):
        conn.recv_into(dest[:size], deadline)
        return
    for part in dest:
        n = min(len(part), size)
        if n:
            conn.recv_into(part[:n], deadline)
        size -= n
