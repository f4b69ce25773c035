"""gcache.Client: ring routing, batched fan-out, zero-copy into caller buffers.

Every operation is a batch. A batch is split by owner (the consistent-hash ring, computed
here; no metadata service on the I/O path); each owner gets one request, all requests are
sent before any reply is read, so the owners work in parallel and the batch costs one round
trip. Values go from the caller's buffers to the socket with sendmsg, and from the socket into
the caller's buffers with recv_into.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Self

from gcache.client.buffers import as_view
from gcache.client.config import ClientConfig, LocalPath, OnNodeError, timeout_error
from gcache.client.each_node import each_node
from gcache.client.fanout import Fanout
from gcache.client.keys import KeyLike, check_deadline, check_keys, key_bytes, per_key
from gcache.client.ops import GetOp, Operation, PutOp
from gcache.client.pool import Pool
from gcache.client.replies import OK, Dest, parts
from gcache.client.routing import MembershipWatcher, RoutingView, rate_limited
from gcache.client.staging import StagingPool, is_device_tensor
from gcache.env import SCHEME
from gcache.errors import ClientClosed, ConfigError, GCacheError
from gcache.meta.master_client import MasterClient
from gcache.meta.membership import Membership, NodeState
from gcache.meta.rpc import CLIENT_CHANNEL_OPTIONS, load_token
from gcache.protocol import Op, Status, namespace_error
from gcache.tier.valuemeta import ValueMeta
from gcache.transport import Transport

CLEAR_TIMEOUT_S = 30.0  # a clear deletes a namespace's every key: longer than a batch call
CLEAR_ROUNDS = 3  # a clear is sent again to a membership that changed meanwhile, at most this often

__all__ = ["ClearResult", "Client", "ClientConfig", "GetResult", "LocalPath", "OnNodeError", "Transport"]


@dataclass
class GetResult:
    """Per-key outcome of get_into: ``status[i]`` and, for OK, ``sizes[i]`` bytes written;
    ``meta[i]``: the hit's value-metadata record, when asked for (``with_meta=True``)."""

    status: list[Status]
    sizes: list[int]
    meta: list[ValueMeta | None] | None = None

    @property
    def hits(self) -> int:
        return sum(1 for s in self.status if s is OK)

    def ok(self) -> list[bool]:
        return [s is OK for s in self.status]


@dataclass
class ClearResult:
    """Outcome of Client.clear: keys deleted per daemon that acknowledged, and why each other
    daemon did not (unreachable, timed out, refused); those keep their keys of the namespace."""

    deleted: dict[str, int]
    failed: dict[str, str]

    @property
    def complete(self) -> bool:
        """Every daemon of the membership acknowledged: no key of the namespace is left."""
        return not self.failed


class Client:
    def __init__(self, nodes: str | Iterable[str] | Membership, config: ClientConfig | None = None,
                 **settings: Any) -> None:
        """``nodes``: ``"gcache://M1:PORT,M2:PORT"`` (the master group: membership is fetched and
        followed), a list of daemon HOST:PORT (a static cluster), or a Membership. ``config``:
        the settings (gcache.client.config.ClientConfig); keyword ``settings`` override its fields
        (``Client(nodes, namespace="a", timeout_s=1.0)``). A Client serves the process that made
        it (any number of its threads); in a process forked from that one, every call raises
        ClientForked: make a new Client there (closing the inherited one is safe)."""
        try:
            cfg = replace(config or ClientConfig(), **settings)
        except TypeError as exc:  # an unknown setting
            raise TypeError(f"Client: {exc} (the settings are ClientConfig's fields)") from None
        if cfg.token is None:
            cfg = replace(cfg, token=load_token(None))
        self.config = cfg
        if cfg.transport is Transport.UCX:  # load ucxx now (~1 s), not inside the first call's deadline
            from gcache.transport import ucx

            ok, why = ucx.available()
            if not ok:
                raise ConfigError(f"transport=UCX: {why}")
        self._pool = Pool(cfg.connect_timeout_s, cfg.max_idle_per_node, cfg.token, cfg.local_path, cfg.transport)
        self._lock = threading.Lock()
        self._watcher: MembershipWatcher | None = None
        self._staging: StagingPool | None = None
        self._fanout = Fanout(self._pool, cfg.timeout_s, cfg.split_bytes, cfg.split_keys, lambda: self._view,
                              self.refresh_membership, rate_limited(0.05), cfg.local_min_bytes)
        if isinstance(nodes, str) and nodes.startswith(SCHEME):
            # one round trip: the watch stream's first message is the whole membership
            masters = MasterClient(nodes, cfg.token, timeout_s=cfg.connect_timeout_s * 2,
                                   channel_options=CLIENT_CHANNEL_OPTIONS)
            try:
                self._watcher = MembershipWatcher.attach(masters, self.update_membership, nodes)
            except GCacheError:
                self._pool.close()
                raise
        else:
            membership = nodes if isinstance(nodes, Membership) else Membership.from_addresses(
                [nodes] if isinstance(nodes, str) else nodes)
            self.update_membership(membership)

    @property
    def namespace(self) -> str:
        return self.config.namespace

    def _ns(self, namespace: str | None) -> str:
        """The namespace a call names: None is the client's own; anything else must be a valid
        namespace (an empty one is refused, not taken for the client's: a clear of it would
        wipe the client's namespace)."""
        if namespace is None:
            return self.namespace
        if err := namespace_error(namespace):
            raise ValueError(err)
        return namespace

    @property
    def token(self) -> str | None:
        return self.config.token

    @property
    def timeout_s(self) -> float:
        return self.config.timeout_s

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
        watcher, self._watcher = self._watcher, None  # first: a refresh its stop() breaks sees it closed
        if watcher is not None and self._pool.owned():  # in a forked child its thread and channel are not ours
            watcher.stop()
        self._pool.close()

    # -- membership -------------------------------------------------------------------------
    def update_membership(self, membership: Membership) -> None:
        """Swap in a newer membership; calls already running finish on the old one."""
        current: RoutingView | None = getattr(self, "_view", None)
        if current is not None and membership.epoch < current.epoch:
            return
        view = RoutingView.build(membership, allow_empty=current is not None)  # the ring: outside the lock
        with self._lock:  # the watch and a refresh (or the bootstrap) may swap at once: never back
            current = getattr(self, "_view", None)
            if current is None or membership.epoch >= current.epoch:
                self._view = view

    def refresh_membership(self, deadline: float | None = None) -> bool:
        """Ask the masters for the membership now (by ``deadline``, time.monotonic(), when
        given); True if it changed."""
        watcher = self._watcher  # once: close() may clear it meanwhile
        if watcher is None:
            return False
        before = self._view.epoch
        try:
            m = watcher.refresh(deadline)
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!": close() stopped the watcher
            if self._watcher is None:
                raise ClientClosed() from None
            raise
        if m is not None:
            self.update_membership(m)
        return self._view.epoch != before

    def owners(self, keys: Sequence[KeyLike], namespace: str | None = None) -> list[str]:
        """Node id that owns each key."""
        check_keys(keys)
        return self._view.ring.owners(self._ns(namespace), [key_bytes(k) for k in keys])

    # -- batch operations -------------------------------------------------------------------
    def put(self, keys: Sequence[KeyLike], values: Sequence[Any], *, ttl_s: float | Sequence[float] = 0.0,
            namespace: str | None = None, pool: str | None = None, pos: Sequence[int] | None = None,
            tail: Sequence[int] | None = None, fmt: int | Sequence[int] = 0, handover: bool | str = False,
            deadline: float | None = None) -> list[Status]:
        """Store values (bytes-like, numpy arrays, CPU or GPU tensors); per-key Status.

        A value may also be a list/tuple of buffers, stored as their concatenation (sent
        scatter-gather, not copied). Each value carries a metadata record (gcache.tier.valuemeta)
        that the daemons keep with it in RAM, on disk and through handovers: ``ttl_s`` (one for
        all keys or one per key), ``pool`` (a daemon pool: own byte budget, prefix-aware
        eviction), ``pos`` (each key's position in its page chain), ``tail`` (1: a restore
        point's trailing-window page) and ``fmt`` (your format tag, an unsigned 32-bit int;
        one for all or one per key). See gcache.tier.pools.
        ``handover`` is for daemons pushing keys to their new owner: each is stored only where no
        client has written or deleted it meanwhile (gcache.server.touchlog), and only while the
        receiver's membership has a handover open (with the pushing node's id, ``handover="n1"``:
        one that node is part of). ``deadline``
        (time.monotonic()): end the batch by then if that is sooner than ``timeout_s`` from now
        (one deadline for several calls)."""
        check_keys(keys)
        check_deadline(deadline)
        namespace = self._ns(namespace)
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        n = len(keys)
        ttls = per_key("ttl_s", ttl_s, n, float)
        fmts = per_key("fmt", fmt, n, int)
        if not all(0 <= t < math.inf for t in (ttls if isinstance(ttls, list) else [ttls])):  # NaN fails too
            raise ValueError("ttl_s must be a finite number of seconds >= 0 (0: no expiry)")
        if any(not 0 <= f < 1 << 32 for f in (fmts if isinstance(fmts, list) else [fmts])):
            raise ValueError("fmt must be an unsigned 32-bit int")
        pos_ = per_key("pos", list(pos), n, int) if pos is not None else None
        tail_ = per_key("tail", list(tail), n, int) if tail is not None else None
        if any(is_device_tensor(v) for v in values):
            return self.staging().put(self, keys, values, ttl_s=ttls, namespace=namespace, pool=pool, pos=pos_,
                                      tail=tail_, fmt=fmts, deadline=deadline)
        kb = [k if type(k) is bytes else key_bytes(k) for k in keys]
        if len(set(kb)) != n:
            # the same key more than once: the last value wins, as if written in order (the
            # copies could go out in different requests, landing in any order)
            last = {k: i for i, k in enumerate(kb)}
            keep = sorted(last.values())

            def pick(v: Any) -> Any:
                return [v[i] for i in keep] if isinstance(v, list) else v

            st = self.put([kb[i] for i in keep], [values[i] for i in keep], ttl_s=pick(ttls), namespace=namespace,
                          pool=pool, pos=pick(pos_), tail=pick(tail_), fmt=pick(fmts), handover=handover,
                          deadline=deadline)
            got = dict(zip(keep, st))
            return [got[last[k]] for k in kb]
        op = PutOp(namespace, [parts(v) for v in values],
                   {"ttl": ttls, "fmt": fmts, "pos": pos_, "tail": tail_}, pool, handover)
        self._run(op, kb, deadline)
        return op.status

    def get_into(self, keys: Sequence[KeyLike], buffers: Sequence[Any], *,
                 namespace: str | None = None, with_meta: bool = False) -> GetResult:
        """Read values straight into the caller's buffers (each at least the value's size). A
        buffer may be a list/tuple of buffers, filled in order (scatter). ``with_meta``: also
        return each hit's value-metadata record (GetResult.meta; not for device tensors)."""
        check_keys(keys)
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if any(is_device_tensor(b) for b in buffers):
            staging = self.staging()
            st = staging.get_into(self, keys, buffers, namespace=namespace)
            return GetResult(st, [staging.copier.nbytes(b) if s is OK else 0 for s, b in zip(st, buffers)])
        views: list[Dest] = [parts(b, True) if isinstance(b, (list, tuple)) else as_view(b, writable=True)
                             for b in buffers]
        return self._get(keys, views, self._ns(namespace), with_meta)[0]

    def get(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[bytearray | None]:
        """Read values into new bytearrays (convenience; get_into avoids the allocation)."""
        check_keys(keys)
        res, bufs = self._get(keys, None, self._ns(namespace))
        return [buf if st is OK else None for st, buf in zip(res.status, bufs)]

    def exists(self, keys: Sequence[KeyLike], *, namespace: str | None = None,
               tail: Sequence[int] | None = None, deadline: float | None = None,
               timeout_s: float | None = None) -> list[bool]:
        """Whether each key is stored (a hit refreshes its recency). ``tail`` re-marks existing
        pooled pages as restore-point (1) or interior (0) pages. ``deadline``: as for put.
        ``timeout_s``: this call's timeout instead of the client's (a very large batch)."""
        check_keys(keys)
        check_deadline(deadline)
        if tail is not None and len(tail) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(tail)} tail values")
        per_key = {"tail": [int(t) for t in tail]} if tail is not None else None
        op = Operation(Op.EXISTS, self._ns(namespace), len(keys), per_key)
        self._run(op, keys, deadline, timeout_s)
        return [s is OK for s in op.status]

    def delete(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[bool]:
        """True for each key that existed."""
        return [s is OK for s in self.delete_status(keys, namespace=namespace)]

    def delete_status(self, keys: Sequence[KeyLike], *, namespace: str | None = None) -> list[Status]:
        """Delete, with each key's Status: OK (it existed), NOT_FOUND, or (with OnNodeError.MISS)
        UNAVAILABLE when its owner failed, so the delete may not have happened."""
        check_keys(keys)
        op = Operation(Op.DELETE, self._ns(namespace), len(keys))
        self._run(op, keys)
        return op.status

    def clear(self, *, namespace: str | None = None, timeout_s: float | None = None) -> ClearResult:
        """Delete every key of the namespace on every daemon of the current membership (all at
        once; DOWN ones hold nothing they will serve again), again while the membership changed
        meanwhile (a joiner may have been handed keys). ``complete`` only when each one
        acknowledged; one that did not keeps its keys. ``timeout_s``: per round (default the
        larger of the client's timeout and CLEAR_TIMEOUT_S)."""
        ns = self._ns(namespace)
        self.refresh_membership()
        deleted: dict[str, int] = {}
        for _ in range(CLEAR_ROUNDS):
            epoch = self._view.epoch
            nodes = {n.node_id: n.address for n in self.membership.nodes if n.state is not NodeState.DOWN}
            out = self._each_node(Op.CLEAR, lambda meta: {"n": int(meta.get("n", 0))}, meta={"ns": ns},
                                  nodes=nodes, timeout_s=timeout_s or max(self.timeout_s, CLEAR_TIMEOUT_S))
            res = ClearResult({n: deleted.get(n, 0) + r["n"] for n, r in out.items() if "error" not in r},
                              {n: r["error"] for n, r in out.items() if "error" in r})
            deleted = res.deleted
            self.refresh_membership()
            if self._view.epoch == epoch or not res.complete:
                return res
        res.failed["membership"] = f"the membership changed during each of {CLEAR_ROUNDS} rounds: a joiner may hold keys"
        return res

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
    def _get(self, keys: Sequence[KeyLike], views: list[Dest] | None, ns: str,
             with_meta: bool = False) -> tuple[GetResult, list[Any]]:
        """Into ``views``, or (views None) into new bytearrays; returns the result and buffers."""
        op = GetOp(ns, len(keys), views, with_meta)
        self._run(op, keys)
        metas = op.metas
        if metas is not None:
            metas = [m if st is OK else None for m, st in zip(metas, op.status)]
        return GetResult(op.status, op.sizes_out, metas), op.bufs

    def _run(self, op: Operation, keys: Sequence[KeyLike], deadline: float | None = None,
             timeout_s: float | None = None) -> None:
        """Run a batch (gcache.client.fanout), by ``deadline`` when that is sooner than the
        client's timeout_s; with OnNodeError.RAISE the first failure of an owner is raised once
        the others have answered."""
        err = namespace_error(op.ns)
        if err:
            raise ValueError(err)
        self._pool.check_usable()  # raised whatever on_node_error says: never a miss
        if not keys:
            return
        if timeout_s is not None and (err := timeout_error("timeout_s", timeout_s)):
            raise ValueError(err)
        failures = self._fanout.run(op, [k if type(k) is bytes else key_bytes(k) for k in keys], deadline, timeout_s)
        if failures and self.config.on_node_error is OnNodeError.RAISE:
            raise failures[0]
        if failures and self.config.on_failure is not None:
            for exc in failures:
                self.config.on_failure(exc)

    def staging(self) -> StagingPool:
        """The pinned staging pool that carries device tensors over host transports."""
        with self._lock:
            if self._staging is None:
                self._staging = StagingPool()
            return self._staging

    def _each_node(self, op: Op, pick: Callable[[dict[str, Any]], dict[str, Any]], only: str | None = None,
                   meta: dict[str, Any] | None = None, nodes: dict[str, str] | None = None,
                   timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """``op`` (with ``meta``) to each owning node (or ``nodes``: id -> address): {node:
        pick(reply)}, or {node: {"error": why}} (gcache.client.each_node)."""
        self._pool.check_usable()
        targets = {n: a for n, a in (self._view.addr if nodes is None else nodes).items() if only in (None, n)}
        return each_node(self._pool, targets, op, meta or {}, pick, timeout_s or self.timeout_s)
