"""gcache as SGLang's multimodal global embedding store (EPD encoders, ``--enable-mm-global-cache``).

``GCacheEmbeddingStore`` implements ``sglang.srt.mem_cache.embedding_store.EmbeddingStore`` for
the ``EmbeddingCacheController``. Turn it on with ``python -m sglang_adapter.launch ...
--enable-mm-global-cache --mm-global-cache-backend gcache`` (see launch.py, docs/sglang.md).

* Zero-copy: the controller hands raw pointers into its host pool, one per page run of an
  embedding; each embedding is one gcache value sent (put) or received (get) scatter-gather
  straight from / into those runs, and a whole batch is one gcache batch (all owners at once).
  Encoders on the same host as the owning daemon copy through its shared-memory arena (no TCP).
* Self-describing keys (emb_config.py): the controller registers its pools with
  ``register_buffer``; the pool a pointer falls in gives the modality, dtype and hidden size,
  which go into the key with the model name, the model identity SGLang's server arguments give
  (the checkpoint, revision, load format, dtype, quantization...: pages.model_identity, the part
  of the KV pages' identity that decides the encoder's output) and the format version. A pointer outside every
  registered pool is refused (a miss), never guessed. A stored value whose size is not what the
  reader expects is a miss too.
* Failure: every batch call answers per-embedding False on any error, never raises; the client
  runs with OnNodeError.MISS, so a dead daemon is a miss within ``timeout_s``. An owner that
  failed (a refused token above all: every call would miss) is logged, rate-limited, and counted.
* Empty embeddings (0 bytes) are refused: stored, one would answer "exists" for its hash forever
  (skip_existing would never store the real one). A stored entry that cannot be an embedding of
  the reader's format (empty, or not a whole number of rows) is deleted when read, so the next
  put stores the real one.
* Budget: puts are tagged with the daemon pool ``emb`` (``gcache daemon --pool-budget emb=...``).
* ``metrics()``: counters since start (keys, hits, bytes, seconds per operation).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import FrameType
from typing import Any

from sglang.srt.mem_cache.embedding_store import EmbeddingStore

from gcache.client import Client
from gcache.client.client import OnNodeError
from gcache.errors import GCacheError
from gcache.protocol import Status
from gcache.ratelog import RateLimitedLog
from sglang_adapter.config import write_deadlines
from sglang_adapter.emb_config import (
    EmbeddingFormat,
    EmbeddingStoreConfig,
    embedding_keys,
    hash_ok,
    identity_tag,
)
from sglang_adapter.failures import report_owner_failure
from sglang_adapter.pages import model_identity, served_model

log = logging.getLogger(__name__)
_DEFAULT_MODALITIES = ("vision", "audio")  # the order EmbeddingCacheController registers its pools in


def _view(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def _pool_modality(tensor: Any) -> str | None:
    """The ``modality`` of the EmbeddingPool whose tensor the caller is registering, found in the
    registering frames (EmbeddingCacheController._register_pool_buffer holds it as ``pool``)."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return None
        for value in frame.f_locals.values():
            modality = getattr(value, "modality", None)
            if isinstance(modality, str) and getattr(value, "tensor", None) is tensor:
                return modality
        frame = frame.f_back
    return None


@dataclass(frozen=True)
class _Region:
    """A registered host pool: [base, end) bytes of rows in ``fmt``."""

    base: int
    end: int
    fmt: EmbeddingFormat
    row_bytes: int


@dataclass
class EmbeddingStoreMetrics:
    gets: int = 0
    get_hits: int = 0
    get_bytes: int = 0
    get_s: float = 0.0
    puts: int = 0
    put_stored: int = 0
    put_skipped: int = 0  # already stored (content-addressed: same bytes)
    put_bytes: int = 0
    put_s: float = 0.0
    exists: int = 0
    exist_hits: int = 0
    unregistered: int = 0  # buffers outside every registered pool, or without a valid hash: refused
    too_large: int = 0  # puts refused by a daemon: larger than its --max-value (or its pool budget), or no room
    empty: int = 0  # empty (0-byte) embeddings: refused
    bad_entries: int = 0  # stored entries that cannot be an embedding of the reader's format: deleted
    errors: int = 0  # batch calls that failed as a whole, and owners that failed in a call (misses)


class GCacheEmbeddingStore(EmbeddingStore):
    def __init__(self, storage_config: Mapping[str, Any] | str | None = None, **_: Any) -> None:
        self.config = EmbeddingStoreConfig.load(storage_config, default_model=served_model())
        #: what SGLang's server arguments say about the encoder's output (pages.model_identity):
        #: part of every key, so another checkpoint or weights served under the same name misses
        self.identity = model_identity()
        self._ident = identity_tag(self.identity)
        c = self.config
        self.client = Client(list(c.nodes), namespace=c.namespace, timeout_s=c.timeout_s, token=c.token(),
                             connect_timeout_s=c.connect_timeout_s, on_node_error=OnNodeError.MISS, local=c.local,
                             on_failure=self._owner_failed)
        self._regions: list[_Region] = []
        self._lock = threading.Lock()
        self._m = EmbeddingStoreMetrics()
        self._limited = RateLimitedLog(log, burst=1, window_s=60.0)  # failures repeat on every call: a line a minute

    def __repr__(self) -> str:
        fmts = [f"{r.fmt.modality}:{r.fmt.dtype}x{r.fmt.hidden}" for r in self._regions]
        return f"GCacheEmbeddingStore(model={self.config.model!r}, ns={self.config.namespace!r}, pools={fmts})"

    # -- registration -------------------------------------------------------------------------
    def register_buffer(self, tensor: Any, modality: str | None = None) -> None:
        """Register a host pool: a (tokens, hidden) CPU tensor. ``modality`` defaults to the
        registering EmbeddingPool's, else to the controller's order (vision, then audio)."""
        if tensor.dim() != 2 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"embedding pool must be a contiguous 2-D CPU tensor, got {tuple(tensor.shape)} "
                             f"on {tensor.device}")
        if tensor.numel() == 0:
            return
        modality = modality or _pool_modality(tensor)
        if modality is None:
            n = len(self._regions)
            modality = _DEFAULT_MODALITIES[n] if n < len(_DEFAULT_MODALITIES) else f"pool{n}"
        fmt = EmbeddingFormat(modality, str(tensor.dtype).removeprefix("torch."), int(tensor.shape[1]))
        base = int(tensor.data_ptr())
        region = _Region(base, base + tensor.numel() * tensor.element_size(), fmt,
                         int(tensor.shape[1]) * tensor.element_size())
        with self._lock:
            self._regions = [r for r in self._regions if r.end <= region.base or r.base >= region.end] + [region]
        log.info("gcache embedding store: registered %s pool %s x %s (%d MiB)", modality, fmt.dtype, fmt.hidden,
                 (region.end - region.base) >> 20)

    def get_key(self, mm_hash: str) -> str:
        """The key ``mm_hash`` has under the first registered pool's format."""
        regions = self._regions
        if not regions:
            return super().get_key(mm_hash)
        return embedding_keys([mm_hash], self.config.model, regions[0].fmt, self._ident)[0].decode()

    def _region_of(self, ptrs: Sequence[int], sizes: Sequence[int]) -> _Region | None:
        """The registered pool holding every run of one embedding, or None."""
        if not ptrs or len(ptrs) != len(sizes):
            return None
        p0 = int(ptrs[0])
        for r in self._regions:
            if r.base <= p0 < r.end:
                if all(r.base <= int(p) and int(p) + int(s) <= r.end and int(s) >= 0 for p, s in zip(ptrs, sizes)) \
                        and sum(int(s) for s in sizes) % r.row_bytes == 0:
                    return r
                return None
        return None

    def _plan(self, hashes: Sequence[str], ptrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
              ) -> tuple[list[int], list[bytes], list[list[memoryview]], list[int], list[int]]:
        """Indices of the embeddings that can move, their keys, views over their page runs, their
        byte sizes and their pools' row sizes; embeddings outside every registered pool, and
        empty ones, are left out (counted)."""
        if not len(hashes) == len(ptrs) == len(sizes):
            raise ValueError(f"{len(hashes)} hashes, {len(ptrs)} pointer lists, {len(sizes)} size lists")
        idx: list[int] = []
        keys: list[bytes] = []
        views: list[list[memoryview]] = []
        nbytes: list[int] = []
        rows: list[int] = []
        refused = empty = 0
        for i, (h, p, s) in enumerate(zip(hashes, ptrs, sizes)):
            region = self._region_of(p, s)
            if region is None or not hash_ok(h):
                refused += 1
                continue
            total = sum(int(b) for b in s)
            if total == 0:
                empty += 1
                continue
            idx.append(i)
            keys.append(embedding_keys([h], self.config.model, region.fmt, self._ident)[0])
            views.append([_view(int(a), int(b)) for a, b in zip(p, s)])
            nbytes.append(total)
            rows.append(region.row_bytes)
        if refused:
            with self._lock:
                self._m.unregistered += refused
            self._limited.warning("refused", "gcache embedding store: %d embedding(s) refused as misses: outside every "
                                  "registered pool (register it with register_buffer), across pools, not whole "
                                  "rows, or without a usable hash (a non-empty string without '.', '@', '#')",
                                  refused)
        if empty:
            with self._lock:
                self._m.empty += empty
            self._limited.warning("empty", "gcache embedding store: %d empty (0-byte) embedding(s) refused: an embedding "
                            "has at least one token row; nothing was stored or read for them", empty)
        return idx, keys, views, nbytes, rows

    def _owner_failed(self, exc: GCacheError) -> None:
        """An owner failed in a batch (Client on_failure): its embeddings were answered as misses."""
        with self._lock:
            self._m.errors += 1
        report_owner_failure(self._limited, exc, "gcache embedding store", "embeddings",
                             "'token_file' in the store's config (--gcache-emb-config)")

    def _drop_bad_entries(self, keys: list[bytes]) -> None:
        """Delete stored entries that cannot be an embedding of the reader's format (empty, or
        not a whole number of rows): left there, skip_existing would trust them forever."""
        with self._lock:
            self._m.bad_entries += len(keys)
        self._limited.warning("bad", "gcache embedding store: %d stored value(s) cannot be an embedding (empty, or not "
                              "a whole number of rows): deleted, so the next put stores the real one", len(keys))
        self.client.delete(keys)

    # -- the interface the controller uses ---------------------------------------------------------
    def batch_get_into_multi_buffers(self, hashes: list[str], ptrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[bool]:
        ok = [False] * len(hashes)
        t0 = time.perf_counter()
        try:
            idx, keys, views, nbytes, rows = self._plan(hashes, ptrs, sizes)
            if idx:
                res = self.client.get_into(keys, views)
                for j, i in enumerate(idx):
                    ok[i] = res.status[j] is Status.OK and res.sizes[j] == nbytes[j]
                bad = [keys[j] for j in range(len(idx))
                       if res.status[j] is Status.OK and (res.sizes[j] == 0 or res.sizes[j] % rows[j])]
                if bad:
                    self._drop_bad_entries(bad)
            got = sum(nbytes[j] for j, i in enumerate(idx) if ok[i])
        except Exception:
            log.exception("gcache embedding get of %d embeddings failed", len(hashes))
            return self._failed(len(hashes))
        with self._lock:
            self._m.gets += len(hashes)
            self._m.get_hits += sum(ok)
            self._m.get_bytes += got
            self._m.get_s += time.perf_counter() - t0
        return ok

    def batch_put_from_multi_buffers(self, hashes: list[str], ptrs: list[list[int]],
                                     sizes: list[list[int]]) -> list[bool]:
        ok = [False] * len(hashes)
        t0 = time.perf_counter()
        try:
            idx, keys, views, nbytes, _rows = self._plan(hashes, ptrs, sizes)
            put_by = None  # the client's own timeout_s
            if idx and self.config.skip_existing:
                exists_by, put_by = write_deadlines(self.config.timeout_s)  # one timeout_s for both rounds
                have = self.client.exists(keys, deadline=exists_by)
            else:
                have = [False] * len(idx)
            todo = [j for j in range(len(idx)) if not have[j]]
            for j in range(len(idx)):
                ok[idx[j]] = have[j]
            if todo:
                st = self.client.put([keys[j] for j in todo], [views[j] for j in todo], pool=self.config.pool,
                                     deadline=put_by)
                for j, s in zip(todo, st):
                    ok[idx[j]] = s is Status.OK
                refused = [nbytes[j] for j, s in zip(todo, st) if s in (Status.TOO_LARGE, Status.FULL)]
                if refused:
                    with self._lock:
                        self._m.too_large += len(refused)
                    self._limited.warning("too-large", "gcache embedding store: %d embedding(s) not stored, refused "
                                          "by a daemon as too large or with no room (largest %d bytes): raise the "
                                          "daemons' --max-value, or the pool's --pool-budget", len(refused),
                                          max(refused))
            stored = [j for j in todo if ok[idx[j]]]
        except Exception:
            log.exception("gcache embedding put of %d embeddings failed", len(hashes))
            return self._failed(len(hashes))
        with self._lock:
            self._m.puts += len(hashes)
            self._m.put_stored += len(stored)
            self._m.put_skipped += sum(have)
            self._m.put_bytes += sum(nbytes[j] for j in stored)
            self._m.put_s += time.perf_counter() - t0
        return ok

    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        """Whether each embedding is stored in the format of any registered pool (the controller
        does not say which modality it asks about; a prefetch into another pool is then a miss)."""
        n = len(hashes)
        try:
            fmts = list(dict.fromkeys(r.fmt for r in self._regions))
            if not n or not fmts:
                return [False] * n
            good = [i for i, h in enumerate(hashes) if hash_ok(h)]  # another one is a miss, alone
            m = len(good)
            keys = [k for f in fmts for k in embedding_keys([hashes[i] for i in good], self.config.model, f,
                                                             self._ident)]
            ex = self.client.exists(keys) if keys else []
            out = [False] * n
            for g, i in enumerate(good):
                out[i] = any(ex[j * m + g] for j in range(len(fmts)))
        except Exception:
            log.exception("gcache embedding exists of %d embeddings failed", n)
            return self._failed(n)
        with self._lock:
            self._m.exists += n
            self._m.exist_hits += sum(out)
        return out

    # -- single-buffer forms (one contiguous buffer per embedding) ------------------------------
    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.batch_get_into_multi_buffers(hashes, [[p] for p in ptrs], [[s] for s in sizes])

    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        return self.batch_put_from_multi_buffers(hashes, [[p] for p in ptrs], [[s] for s in sizes])

    # -- metrics and lifetime -----------------------------------------------------------------------
    def _failed(self, n: int) -> list[bool]:
        with self._lock:
            self._m.errors += 1
        return [False] * n

    def metrics(self) -> dict[str, float]:
        """Counters since start: keys, hits, bytes and seconds of gets, puts and exists."""
        with self._lock:
            return {f.name: getattr(self._m, f.name) for f in fields(self._m)}

    def close(self) -> None:
        self.client.close()
