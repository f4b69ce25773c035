"""Batch operations as data: what each request of a batch carries, and what each reply means.

An operation holds the batch's per-key inputs and results (``status``, and for gets the sizes,
buffers and metadata records). gcache.client.fanout sends ``request(idxs)`` to each owner and
hands the reply to ``finish`` (TCP, UCX, memory) or ``finish_local`` (the shared-memory path,
gcache.client.localpath).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gcache.client.localpath import Pending, commit_put, copy_out
from gcache.client.replies import BUFFER_TOO_SMALL, OK, Dest, fill_views, nbytes, statuses
from gcache.errors import ProtocolError
from gcache.protocol import Op, Status
from gcache.tier.valuemeta import ValueMeta
from gcache.transport import Connection

if TYPE_CHECKING:
    from gcache.client.pool import Pool

Meta = dict[str, Any]


class Operation:
    """The base: an operation on keys only (EXISTS, DELETE), one Status per key back."""

    moves_values = False  # a request carries values or answers with them (else: keys and statuses only)
    local_op: Op | None = None  # what a request over the local path is (None: the same as over TCP)
    lease_round_trips = 1  # synchronous round trips of local_op's lease protocol (LGET; LDONE is one-way)
    sizes: Sequence[int] | None = None  # per-key bytes, when known (splits large batches)

    def __init__(self, op: Op, ns: str, n: int, per_key: dict[str, list[int]] | None = None) -> None:
        self.op = op
        self.ns = ns
        self.status = [Status.ERROR] * n
        self.per_key = per_key or {}
        self.fallback = op is Op.EXISTS  # misses during a handover are looked up on the previous owner

    def request(self, idxs: list[int], kb: list[bytes]) -> tuple[Meta, list[memoryview]]:
        meta: Meta = {"ns": self.ns, "keys": kb}
        for name, values in self.per_key.items():
            meta[name] = [values[i] for i in idxs]
        return meta, []

    def finish(self, idxs: list[int], reply: Meta, plen: int, conn: Connection, deadline: float) -> None:
        for i, st in zip(idxs, statuses(reply, len(idxs), conn.node)):
            self.status[i] = st

    def finish_local(self, idxs: list[int], reply: Meta, conn: Connection, pool: Pool, deadline: float) -> Pending:
        raise NotImplementedError(f"{self.op.name} has no local-path form")


class PutOp(Operation):
    """PUT: values from the caller's buffers (each a list of parts, sent scatter-gather) with
    their metadata fields (one value for all keys, or one per key)."""

    moves_values = True
    local_op = Op.LALLOC
    lease_round_trips = 2  # LALLOC, then LCOMMIT

    def __init__(self, ns: str, views: list[list[memoryview]], fields: dict[str, Any], pool: str | None,
                 handover: bool | str) -> None:
        super().__init__(Op.PUT, ns, len(views))
        self.views = views
        self.fields = fields  # ttl / fmt / pos / tail: a list (per key) or one value (all keys)
        self.pool = pool
        self.handover = handover
        self.value_sizes = [sum(map(len, v)) for v in views]
        self.sizes = self.value_sizes

    def request(self, idxs: list[int], kb: list[bytes]) -> tuple[Meta, list[memoryview]]:
        meta: Meta = {"ns": self.ns, "keys": kb, "sizes": [self.value_sizes[i] for i in idxs]}
        for name, value in self.fields.items():
            if isinstance(value, list):
                meta[name] = [value[i] for i in idxs]
            elif value:
                meta[name] = value
        if self.handover:
            meta["ho"] = self.handover if isinstance(self.handover, str) else 1  # the pushing node, when named
        if self.pool is not None:
            meta["pool"] = self.pool
        return meta, [part for i in idxs for part in self.views[i]]

    def finish_local(self, idxs: list[int], reply: Meta, conn: Connection, pool: Pool, deadline: float) -> Pending:
        return commit_put(self, idxs, reply, conn, pool, deadline)


class GetOp(Operation):
    """GET: each hit's bytes into the caller's buffer (``views``) or, without buffers, into a
    new bytearray (``bufs``); ``with_meta`` also collects each hit's value-metadata record."""

    moves_values = True
    local_op = Op.LGET

    def __init__(self, ns: str, n: int, views: list[Dest] | None, with_meta: bool) -> None:
        super().__init__(Op.GET, ns, n)
        self.fallback = True
        self.views = views
        self.bufs: list[Any] = list(views) if views is not None else [None] * n
        self.sizes_out = [0] * n
        self.metas: list[ValueMeta | None] | None = [None] * n if with_meta else None
        self.sizes = [nbytes(v) for v in views] if views is not None else None

    def request(self, idxs: list[int], kb: list[bytes]) -> tuple[Meta, list[memoryview]]:
        return ({"ns": self.ns, "keys": kb, "vm": 1} if self.metas is not None else {"ns": self.ns, "keys": kb}), []

    def dest(self, i: int, size: int) -> Dest:
        """Where key i's value goes: the caller's buffer, or a new bytearray."""
        if self.views is None:
            self.bufs[i] = bytearray(size)
            return memoryview(self.bufs[i])
        return self.views[i]

    def take_meta(self, idxs: list[int], reply: Meta) -> None:
        vm = reply.get("vm")
        if self.metas is not None and isinstance(vm, list) and len(vm) == len(idxs):
            for i, v in zip(idxs, vm):
                self.metas[i] = ValueMeta.from_wire(v)

    def finish(self, idxs: list[int], reply: Meta, plen: int, conn: Connection, deadline: float) -> None:
        sts = statuses(reply, len(idxs), conn.node)
        szs = reply.get("sz")
        if not isinstance(szs, list) or len(szs) != len(idxs):
            conn.broken = True
            raise ProtocolError(f"{conn.node}: GET reply without one size per key")
        if sum(sz for st, sz in zip(sts, szs) if st is OK) != plen:
            conn.broken = True
            raise ProtocolError(f"{conn.node}: GET reply sizes do not add up to its payload")
        into: list[memoryview] = []  # hits' bytes, in reply order: received in one go
        for i, st, sz in zip(idxs, sts, szs):
            self.sizes_out[i] = sz
            if st is not OK:
                self.status[i] = st
                continue
            dest = self.dest(i, sz)
            if nbytes(dest) < sz:  # read and dropped (in bounded chunks), keeping the reply in sync
                conn.recv_scatter(into, deadline)
                into = []
                conn.discard(sz, deadline)
                self.status[i] = BUFFER_TOO_SMALL
                continue
            into += fill_views(dest, sz)
            self.status[i] = OK
        conn.recv_scatter(into, deadline)
        self.take_meta(idxs, reply)

    def finish_local(self, idxs: list[int], reply: Meta, conn: Connection, pool: Pool, deadline: float) -> Pending:
        return copy_out(self, idxs, reply, conn, deadline)
