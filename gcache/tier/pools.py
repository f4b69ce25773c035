"""Pools: tagged partitions of the RAM tier with their own byte budget and eviction order.

A put may carry a pool tag (``"kv"``, ``"swa"``, ...). Entries of one (namespace, pool) form a
:class:`PoolGroup`: its bytes count against that pool's budget, and when it is over budget only
its own entries are evicted, so one pool's pressure never evicts another pool's pages. Untagged
entries behave exactly as before (the plain LRU in :class:`~gcache.tier.ram.RamTier`).

Eviction order inside a group is prefix-aware. Each entry carries its position in its page
chain and an order key ``(tail, recency bucket, -position, seq)``; the smallest goes first:

* ``tail``: 0 for interior pages, 1 for pages of a stored sequence's trailing window (SWA
  restore points). Interior windows go before any restore point.
* recency bucket: ``int(now / bucket_s)`` of the last put, get or exists that touched it.
* ``-position``: within a bucket, later pages of a chain go before earlier ones, so eviction
  does not leave a hole that strands the pages after it. Because a reader always touches a
  chain from its start, a prefix is never older than the pages that follow it.
* ``seq``: insertion/touch order, a unique tie-breaker.

Budgets are configured per daemon (``--pool-budget [NAMESPACE:]POOL=SIZE|PCT%``); a pool with
no budget is bounded only by the arena. Pure logic, no locking: the store's lock covers it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sortedcontainers import SortedList

from gcache.errors import ConfigError
from gcache.sizes import parse_size
from gcache.tier.allocator import aligned

if TYPE_CHECKING:
    from gcache.tier.ram import Key, RamEntry

MAX_POOL_NAME = 64
_POOL_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
GroupId = tuple[str, str]  # (namespace, pool)


def pool_name_error(pool: object) -> str | None:
    """Why ``pool`` is not a valid pool name, or None."""
    if not isinstance(pool, str) or not _POOL_RE.match(pool):
        return f"pool must be 1..{MAX_POOL_NAME} characters of [A-Za-z0-9_.-], got {pool!r}"
    return None


@dataclass(frozen=True)
class PoolBudget:
    """``bytes`` for pool ``pool`` in ``namespace`` (None: every namespace, each separately)."""

    pool: str
    bytes: int
    namespace: str | None = None

    @classmethod
    def parse(cls, spec: str, mem_bytes: int) -> PoolBudget:
        """``[NAMESPACE:]POOL=SIZE`` where SIZE is ``64MiB``-style or a percentage of the arena."""
        left, eq, size = spec.partition("=")
        if not eq or not size.strip():
            raise ConfigError(f"--pool-budget {spec!r}: expected [NAMESPACE:]POOL=SIZE or POOL=PCT%")
        ns, _, pool = left.strip().rpartition(":")
        err = pool_name_error(pool)
        if err:
            raise ConfigError(f"--pool-budget {spec!r}: {err}")
        size = size.strip()
        try:
            if size.endswith("%"):
                pct = float(size[:-1])
                if not 0 < pct <= 100:
                    raise ValueError
                nbytes = int(mem_bytes * pct / 100)
            else:
                nbytes = parse_size(size)
        except (ValueError, ConfigError):
            raise ConfigError(f"--pool-budget {spec!r}: SIZE must be bytes (e.g. 256MiB) or 0-100%") from None
        if nbytes <= 0:
            raise ConfigError(f"--pool-budget {spec!r}: the budget must be > 0 bytes")
        return cls(pool, nbytes, ns or None)


class PoolBudgets:
    """Budget lookup: a namespace-specific budget wins over the every-namespace one."""

    def __init__(self, budgets: tuple[PoolBudget, ...], mem_bytes: int) -> None:
        self._any: dict[str, int] = {}
        self._ns: dict[GroupId, int] = {}
        for b in budgets:
            table, k = (self._any, b.pool) if b.namespace is None else (self._ns, (b.namespace, b.pool))
            if k in table:
                raise ConfigError(f"pool budget for {k} given twice")
            table[k] = b.bytes  # type: ignore[index]
        self._check(mem_bytes)

    def _check(self, mem_bytes: int) -> None:
        if sum(self._any.values()) > mem_bytes:
            raise ConfigError(f"pool budgets {self._any} add up to more than the arena ({mem_bytes} bytes)")
        for ns in {ns for ns, _ in self._ns}:
            eff = dict(self._any)
            eff.update({p: b for (n, p), b in self._ns.items() if n == ns})
            if sum(eff.values()) > mem_bytes:
                raise ConfigError(f"pool budgets of namespace {ns!r} ({eff}) add up to more than the "
                                  f"arena ({mem_bytes} bytes)")

    def budget(self, group: GroupId) -> int | None:
        b = self._ns.get(group)
        return b if b is not None else self._any.get(group[1])

    def __bool__(self) -> bool:
        return bool(self._any or self._ns)


class PoolGroup:
    """Entries of one (namespace, pool), in eviction order (see the module docstring)."""

    _seq = itertools.count()

    def __init__(self, gid: GroupId, budget: int | None) -> None:
        self.gid = gid
        self.budget = budget  # None: bounded by the arena only
        self.bytes = 0
        self.order: SortedList = SortedList()
        self.entries: dict[Key, RamEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"PoolGroup({self.gid}, entries={len(self)}, bytes={self.bytes}, budget={self.budget})"

    def add(self, key: Key, entry: RamEntry, bucket: int) -> None:
        entry.okey = (entry.tail, bucket, -entry.pos, next(self._seq), key)
        self.order.add(entry.okey)
        self.entries[key] = entry
        self.bytes += aligned(entry.size)  # arena bytes, as the allocator counts them

    def remove(self, key: Key, entry: RamEntry) -> None:
        if self.entries.pop(key, None) is not None:
            self.order.remove(entry.okey)
            self.bytes -= aligned(entry.size)

    def touch(self, key: Key, entry: RamEntry, bucket: int, tail: int | None = None) -> None:
        """Refresh recency (and optionally the tail mark) of a member."""
        self.order.remove(entry.okey)
        if tail is not None:
            entry.tail = tail
        entry.okey = (entry.tail, bucket, -entry.pos, next(self._seq), key)
        self.order.add(entry.okey)

    def over_budget(self, extra: int, reserved: int = 0) -> bool:
        """Whether ``extra`` more bytes take the pool past its budget, beside ``reserved`` bytes
        a put batch has already reserved for it (not committed yet, so not in ``bytes``)."""
        return self.budget is not None and self.bytes + reserved + aligned(extra) > self.budget

    def victims(self) -> Iterator[tuple[Key, RamEntry]]:
        """Unpinned members, first to evict first. The caller may evict each one yielded."""
        i = 0
        while i < len(self.order):
            okey = self.order[i]
            key = okey[-1]
            entry = self.entries[key]
            if entry.pins:
                i += 1
                continue
            yield key, entry
            if i < len(self.order) and self.order[i] is okey:
                i += 1  # not evicted by the caller: move on


MAX_POS = 1 << 40


def _int_list(meta: dict[str, Any], field: str, n: int, lo: int, hi: int) -> list[int] | str | None:
    v = meta.get(field)
    if v is None:
        return None
    if not isinstance(v, list) or len(v) != n or any(type(x) is not int or not lo <= x <= hi for x in v):
        return f"'{field}' must be a list of one int in [{lo}, {hi}] per key"
    return v


def parse_pool_meta(meta: dict[str, Any], n: int, op: str) -> tuple[str | None, list[int], list[int] | None] | str:
    """The pool fields of a PUT (or LALLOC) or an EXISTS request with ``n`` keys, or why not.

    PUT: ``"pool"`` (optional pool name), ``"pos"`` (chain position per key, default 0),
    ``"tail"`` (1 per key that belongs to a restore point's trailing window, default 0).
    EXISTS: only ``"tail"``, which re-marks existing pooled entries (absent: leave them).
    Returns (pool, pos, tail); tail is None when absent.
    """
    put = op != "EXISTS"  # PUT, or the local fast path's LALLOC
    pool = meta.get("pool") if put else None
    if pool is not None and pool_name_error(pool):
        return pool_name_error(pool)  # type: ignore[return-value]
    pos = _int_list(meta, "pos", n, 0, MAX_POS) if put else None
    if isinstance(pos, str):
        return pos
    tail = _int_list(meta, "tail", n, 0, 1)
    if isinstance(tail, str):
        return tail
    return pool, pos or [0] * n, tail
