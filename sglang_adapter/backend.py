"""gcache as SGLang HiCache's L3 storage backend, SWA-aware.

Load it through the factory's dynamic mechanism::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name":"gcache","module_path":"sglang_adapter.backend",
        "class_name":"GCacheStorage","interface_v1":1,"hicache_storage_pass_prefix_keys":true,
        "nodes":"127.0.0.1:7400,127.0.0.1:7401"}'

``"nodes"`` may also be the master group, ``"gcache://m1:p1,m2:p2"`` (routing then follows its
membership); the token comes from ``"token_file"``, $GCACHE_TOKEN_FILE or $GCACHE_TOKEN.

* v1 (``batch_get_v1`` / ``batch_set_v1``): KV pages move between the registered host pool's
  memory and the daemons without intermediate copies (see pages.py).
* v2 (hybrid pools): KV pages go to the daemon pool "kv", SWA pages to the pool "swa" with its
  own budget; ``batch_exists_v2`` answers the window-safe restorable prefix lengths from one
  parallel round of existence checks (window.py). SWA backups mark their pages as the
  trailing window of a stored sequence and demote the window they supersede, so the daemon
  keeps restore points ahead of interior windows.
* Positions: with ``hicache_storage_pass_prefix_keys`` SGLang passes the chain before each
  batch, so pages are written with their absolute chain position (prefix-aware eviction);
  without it positions are relative to the batch.
* ``clear`` (SGLang's storage clear, e.g. after a weight update): deletes the whole namespace on
  every daemon; True only when every daemon acknowledged (docs/sglang.md).
* Failure: every batch call answers per-page False on any error; a dead daemon is a miss
  within ``timeout_s`` (the client runs with OnNodeError.MISS). Thread-safe: the gcache
  Client is, and the metrics are kept under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost, MHATokenToKVPoolHost

from gcache.client import Client
from gcache.client.client import OnNodeError
from gcache.errors import GCacheError
from gcache.protocol import MAX_KEY_BYTES, Status
from gcache.ratelog import RateLimitedLog
from sglang_adapter.config import AdapterConfig, write_deadlines
from sglang_adapter.failures import report_owner_failure
from sglang_adapter.keys import KeyScheme, model_name, page_format
from sglang_adapter.pages import deployment_identity, page_bytes, page_views, pool_format, served_model
from sglang_adapter.window import PoolCheck, leading, window_safe

CLEAR_WAIT_S = 5.0  # longest a clear holds SGLang's scheduler thread (clear)
EXISTS_KEYS_PER_TIMEOUT = 65536  # keys an existence round may take per timeout_s (_exists_by)
log = logging.getLogger(__name__)
KV = "kv"
#: host pools whose bytes differ per TP rank even in an MLA model (heads or state split over the ranks)
_RANK_SHARDED_POOLS = (MHATokenToKVPoolHost, MHATokenToKOnlyPoolHost, MambaPoolHost)


def _name(pool: Any) -> str:
    return str(getattr(pool, "value", pool))


def _nbytes(buf: Any) -> int:
    """Byte size of a tensor or any buffer."""
    if isinstance(buf, torch.Tensor):
        return buf.numel() * buf.element_size()
    return memoryview(buf).nbytes


def _base(extra_info: HiCacheStorageExtraInfo | None) -> int:
    """Chain position of a batch's first page (0 when SGLang does not pass the prefix)."""
    return len(extra_info.prefix_keys) if extra_info is not None and extra_info.prefix_keys else 0


class GCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.config = AdapterConfig.from_extra(storage_config.extra_config if storage_config else None)
        self.scheme = KeyScheme.from_storage_config(storage_config)
        if not self.scheme.model:
            self.scheme = replace(self.scheme, model=model_name(served_model()))
            if not self.scheme.model:
                log.warning("gcache storage: no model name (storage config nor server arguments): pages "
                            "of another unnamed model with the same pool layout share these keys")
        # SGLang's own rule (HiCacheController.attach_storage_backend) for a dynamic backend: the
        # zero-copy page functions with interface_v1, else the generic ones (batch_get/batch_set of
        # flat page tensors, whose keys batch_exists must then name)
        extra = getattr(storage_config, "extra_config", None) or {}
        self.zero_copy = bool(extra.get("interface_v1", 0))
        self._flat: tuple[Any, str, str, list[int]] | None = None  # (KV host pool, its flat page's kind, dtype, shape)
        self.client = Client(self.config.target(), namespace=self.config.namespace, token=self.config.token(),
                             timeout_s=self.config.timeout_s, connect_timeout_s=self.config.connect_timeout_s,
                             on_node_error=OnNodeError.MISS, local=self.config.local,
                             on_failure=self._owner_failed)
        self._limited = RateLimitedLog(log, burst=1, window_s=60.0)  # failures repeat on every call: a line a minute
        self.registered_pools: dict[str, Any] = {}
        self.mem_pool_host = None
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}
        self._page_gb: dict[str, float] = {}
        self._formats: dict[str, tuple[Any, str, bool]] = {}  # pool name -> (host pool, page format, rank_sharded)
        self.identity = deployment_identity()  # what SGLang's arguments say about the bytes

    def __repr__(self) -> str:
        return f"GCacheStorage(ns={self.config.namespace!r}, pools={sorted(self.registered_pools)})"

    def _owner_failed(self, exc: GCacheError) -> None:
        """An owner failed in a batch (Client on_failure): its pages were answered as misses."""
        report_owner_failure(self._limited, exc, "gcache storage", "pages", "'token_file' in extra_config")

    # -- registration -------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        self.registered_pools[_name(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        log.info("gcache storage: pools %s", sorted(self.registered_pools))

    def _pool(self, name: str) -> Any:
        pool = self.registered_pools.get(name)
        if pool is None and name == KV:
            pool = self.mem_pool_host
        if pool is None:
            raise KeyError(f"host pool {name!r} is not registered")
        return pool

    def page_keys(self, page_hashes: list[str], name: str) -> list[bytes]:
        """gcache keys of pages of the registered host pool ``name``: shard and byte format
        included, so a pool of another layout, dtype or page size never reads these pages."""
        _, fmt, rank_sharded = self._layout(name)
        return self._checked(self.scheme.keys(list(page_hashes), name, fmt, rank_sharded))

    def _checked(self, keys: list[bytes]) -> list[bytes]:
        """``keys``, saying (a line a minute) when one is too long to store: its page is a miss."""
        if keys and max(map(len, keys)) > MAX_KEY_BYTES:
            self._limited.warning("key", "gcache storage: page keys of up to %d bytes exceed gcache's %d (page "
                                  "hashes of %d characters?): those pages are never stored or found",
                                  max(map(len, keys)), MAX_KEY_BYTES, max(len(k.partition(b".")[0]) for k in keys))
        return keys

    def _format(self, name: str) -> str:
        """The page format of the registered host pool ``name`` (pages.pool_format)."""
        return self._layout(name)[1]

    def _layout(self, name: str) -> tuple[Any, str, bool]:
        """The registered host pool ``name``, its page format (pages.pool_format) and whether its
        pages are keyed per TP rank (KeyScheme.rank_sharded; in an MLA model also a side pool
        that splits heads or state over the ranks, such as an MHA draft), made once."""
        pool = self._pool(name)
        cached = self._formats.get(name)
        if cached is None or cached[0] is not pool:
            sharded = self.scheme.rank_sharded(name) or isinstance(pool, _RANK_SHARDED_POOLS)
            cached = self._formats[name] = (pool, pool_format(pool, self.identity), sharded)
            shard = f"{self.scheme.shard(name, sharded)}#{cached[1]}"
            log.info("gcache storage: %s pages are keyed <page hash>.%s@%s%s", name, name, shard,
                     f" (the router's --l3-shard {shard})" if name == KV else "")
        return cached

    def l3_shard(self) -> str:
        """What the router's ``--l3-shard`` takes to find this engine's KV pages: the part of
        their keys after ``@`` (shard and page format; logged when first used)."""
        _, fmt, sharded = self._layout(KV)
        return f"{self.scheme.shard(KV, sharded)}#{fmt}"

    def _tag(self, name: str) -> str:
        """The daemon pool a host pool's pages go to."""
        return name if self.config.dual_pools else KV

    # -- v1: KV pages, zero-copy ----------------------------------------------------------------
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._get_pages(KV, keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._set_pages(KV, keys, host_indices, _base(extra_info), trailing=False)

    def _exists_timeout(self, nkeys: int) -> float:
        """The timeout of one existence round of ``nkeys`` keys: timeout_s, and more for a round
        past EXISTS_KEYS_PER_TIMEOUT keys (a 128k-token prompt at page size 1 is 262,144 keys over
        KV and SWA: a whole miss at timeout_s, though every page was there, where its recompute
        costs far more than the longer wait)."""
        return self.config.timeout_s * max(1.0, nkeys / EXISTS_KEYS_PER_TIMEOUT)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return leading(self.client.exists(self._kv_keys(keys), timeout_s=self._exists_timeout(len(keys))))
        except Exception:
            log.exception("gcache batch_exists failed")
            return 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _kv_keys(self, page_hashes: list[str]) -> list[bytes]:
        """The KV keys the get that follows an existence check looks up: the zero-copy pages with
        interface_v1, else the generic path's flat pages (_flat_page_keys)."""
        return self.page_keys(page_hashes, KV) if self.zero_copy else self._flat_page_keys(page_hashes)

    # -- v2: hybrid pools -------------------------------------------------------------------------
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        try:
            keys = list(keys)
            transfers = list(pool_transfers or [])
            query = self._kv_keys(keys)  # side pools always move zero-copy (batch_get_v2)
            for t in transfers:
                query += self.page_keys(keys, _name(t.name))
            ex = self.client.exists(query, timeout_s=self._exists_timeout(len(query)))  # one round, all owners
            n = len(keys)
            checks = [
                PoolCheck(_name(t.name), ex[n * (j + 1):n * (j + 2)],
                          max(1, len(t.keys or ())) if t.hit_policy == PoolHitPolicy.TRAILING_PAGES else None)
                for j, t in enumerate(transfers)
            ]
            res = window_safe(ex[:n], checks)
            return PoolTransferResult(res.final_pages, dict(res.pool_hits), list(res.restorable))
        except Exception:
            log.exception("gcache batch_exists_v2 failed")
            return PoolTransferResult(0, {}, [])

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {_name(t.name): self._get_pages(_name(t.name), t.keys or [], t.host_indices)
                for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        base = _base(extra_info)
        return {
            _name(t.name): self._set_pages(_name(t.name), t.keys or [], t.host_indices, base,
                                           trailing=t.hit_policy == PoolHitPolicy.TRAILING_PAGES)
            for t in transfers
        }

    # -- page I/O -----------------------------------------------------------------------------------
    def _views(self, name: str, keys: list[str], host_indices: Any) -> tuple[Any, list[list[memoryview]]]:
        pool = self._pool(name)
        page_size = getattr(pool, "page_size", 1) or 1
        if host_indices is None or host_indices.numel() != len(keys) * page_size:
            raise ValueError(f"{name}: {len(keys)} keys but "
                             f"{0 if host_indices is None else host_indices.numel()} host indices")
        return pool, page_views(pool, host_indices, len(keys))

    def _get_pages(self, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        if not keys:
            return []
        try:
            t0 = time.perf_counter()
            pool, views = self._views(name, keys, host_indices)
            res = self.client.get_into(self.page_keys(keys, name), views)
            ok = [st is Status.OK and sz == sum(map(len, v)) for st, sz, v in zip(res.status, res.sizes, views)]
            self._record("prefetch", name, pool, sum(ok), time.perf_counter() - t0)
            return ok
        except Exception:
            log.exception("gcache get of %d %s pages failed", len(keys), name)
            return [False] * len(keys)

    def _set_pages(self, name: str, keys: list[str], host_indices: Any, base: int, trailing: bool) -> list[bool]:
        if not keys:
            return []
        try:
            t0 = time.perf_counter()
            pool, views = self._views(name, keys, host_indices)
            gkeys = self.page_keys(keys, name)
            n = len(keys)
            tail = [1] * n if trailing else None
            have = [False] * n
            put_by = None  # the client's own timeout_s
            if self.config.skip_existing or trailing:
                exists_by, put_by = write_deadlines(self.config.timeout_s)  # one timeout_s for both rounds
                # (no window is re-marked interior here: the pages before this window are not the
                # window it supersedes, and a prefix's window stays the restore point of every
                # other branch off that prefix; a prober saw a shared prefix lose its own)
                found = self.client.exists(gkeys, tail=tail, deadline=exists_by)
                have = found[:n] if self.config.skip_existing else have
            todo = [i for i in range(n) if not have[i]]
            ok = list(have)
            if todo:
                # a trailing window is restorable only whole: its pages share one position (its
                # end), so the pool's order (tail, bucket, -pos, seq) evicts a window's pages
                # together instead of the last page of every window first (a prober: under
                # pressure 63 of 64 windows held were broken, none restorable)
                pos = [base + n - 1] * len(todo) if trailing else [base + i for i in todo]
                st = self.client.put([gkeys[i] for i in todo], [views[i] for i in todo], pool=self._tag(name),
                                     pos=pos, tail=[1] * len(todo) if trailing else None, deadline=put_by)
                for i, s in zip(todo, st):
                    ok[i] = s is Status.OK
            self._record("backup", name, pool, sum(ok[i] for i in todo), time.perf_counter() - t0)
            return ok
        except Exception:
            log.exception("gcache set of %d %s pages failed", len(keys), name)
            return [False] * len(keys)

    # -- legacy (non-zero-copy) interface ---------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        try:
            if target_locations is None or any(t is None for t in target_locations):
                return [None] * len(keys)
            t0 = time.perf_counter()
            gkeys = self._checked([self._tensor_key(k, t) for k, t in zip(keys, target_locations)])
            res = self.client.get_into(gkeys, list(target_locations))
            # a value of another size under the key (another writer) is a miss, never a
            # partly filled tensor
            out = [t if st is Status.OK and n == _nbytes(t) else None
                   for t, st, n in zip(target_locations, res.status, res.sizes)]
            got = [t for t in out if t is not None]
            self._record("prefetch", KV, None, len(got), time.perf_counter() - t0, sum(map(_nbytes, got)))
            return out
        except Exception:
            log.exception("gcache batch_get failed")
            return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        try:
            t0 = time.perf_counter()
            vals = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
            st = self.client.put(self._checked([self._tensor_key(k, v) for k, v in zip(keys, vals)]), vals,
                                 pool=self._tag(KV))
            stored = [v for v, s in zip(vals, st) if s is Status.OK]
            self._record("backup", KV, None, len(stored), time.perf_counter() - t0, sum(map(_nbytes, stored)))
            return all(s is Status.OK for s in st)
        except Exception:
            log.exception("gcache batch_set failed")
            return False

    def _tensor_key(self, page_hash: str, tensor: Any) -> bytes:
        """Key of a whole-tensor value of the legacy path: the tensor's dtype and shape, and the
        format of the host pool it was copied from (SGLang flattens a page, so a page_first and
        a layer_first page have the same shape; fp8 variants the same dtype)."""
        shape = list(getattr(tensor, "shape", ())) or [len(memoryview(tensor).cast("B"))]
        return self._legacy_key(page_hash, type(tensor).__name__, str(getattr(tensor, "dtype", "bytes")), shape)

    def _legacy_key(self, page_hash: str, kind: str, dtype: str, shape: list[int]) -> bytes:
        pool_fmt = self._format(KV) if self.mem_pool_host is not None or KV in self.registered_pools else ""
        fmt = page_format(kind, "tensor", dtype, 0, shape, [f"pool={pool_fmt}", *self.identity])
        return self.scheme.key(page_hash, KV, fmt)

    def _flat_page_keys(self, page_hashes: list[str]) -> list[bytes]:
        """The keys the generic path's batch_get looks up: those of the flat page it reads into
        (the KV host pool's ``get_dummy_flat_data_page``), so batch_exists finds what batch_get
        would."""
        pool = self._pool(KV)
        if self._flat is None or self._flat[0] is not pool:
            page = pool.get_dummy_flat_data_page()
            self._flat = (pool, type(page).__name__, str(page.dtype), list(page.shape))
        _, kind, dtype, shape = self._flat
        return self._checked([self._legacy_key(h, kind, dtype, shape) for h in page_hashes])

    def clear(self) -> bool:
        """Delete every page of this adapter's namespace on every daemon (SGLang's
        /hicache/storage-backend/clear; after a weight update, the KV of the old weights). The
        whole namespace: other deployments sharing it lose their pages too (misses). True only
        when every daemon acknowledged; SGLang answers "cleared" whatever this returns, so a
        clear that did not reach every daemon is logged as an error naming them."""
        ns = self.config.namespace
        try:
            # SGLang calls this on its scheduler thread: a stalled daemon must not stop scheduling
            # for the client's 30 s clear timeout (a prober); a daemon still deleting past this
            # finishes on its own, and is only reported as not acknowledged
            res = self.client.clear(timeout_s=max(self.config.timeout_s, CLEAR_WAIT_S))
        except Exception:
            log.exception("gcache storage: clear of namespace %r failed: it is NOT complete, pages may remain", ns)
            return False
        if not res.complete:
            log.error("gcache storage: clear of namespace %r is NOT complete: %d of %d daemons did not acknowledge "
                      "and keep their pages (%s); clear again", ns, len(res.failed),
                      len(res.failed) + len(res.deleted), "; ".join(res.failed.values()))
            return False
        log.warning("gcache storage: cleared namespace %r on %d daemons (%d pages deleted)", ns, len(res.deleted),
                    sum(res.deleted.values()))
        return True

    # -- metrics ----------------------------------------------------------------------------------
    def _record(self, kind: str, name: str, pool: Any, pages: int, seconds: float,
                nbytes: int | None = None) -> None:
        """Storage metrics of one call: ``pages`` moved in ``seconds``, of ``pool``'s page size
        (or ``nbytes`` in all: the legacy path's whole tensors)."""
        if not pages:
            return
        if nbytes is not None:
            moved_gb = nbytes / (1 << 30)
        else:
            gb = self._page_gb.get(name)
            if gb is None:
                try:
                    gb = self._page_gb[name] = page_bytes(pool) / (1 << 30)
                except Exception:  # noqa: BLE001  (metrics only: never fail an I/O call over them)
                    gb = self._page_gb[name] = 0.0
            moved_gb = pages * gb
        with self._metrics_lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(moved_gb / max(seconds, 1e-9))

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call (pages and GB/s per prefetch / backup)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._metrics_lock:
            m = StorageMetrics(**{k: list(v) for k, v in self._metrics.items()})
            for v in self._metrics.values():
                v.clear()
        return m

    def close(self) -> None:
        self.client.close()
