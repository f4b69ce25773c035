"""The exact per-worker block index, built from the engines' own KV cache events.

SGLang (``--kv-events-config``) publishes msgpack ``KVEventBatch``es of ``BlockStored``
(a chain of pages: engine hashes, the parent page's hash, the pages' token ids),
``BlockRemoved`` (engine hashes) and ``AllBlocksCleared``. The structs below mirror the
wire format of ``sglang.srt.disaggregation.kv_events`` (tagged msgpack maps inside a
positional batch), so the router decodes them without importing sglang.

Engine hashes are opaque. The index re-hashes every stored page with the router's own
chain (``prefix.next_token_hash`` over the page's token ids, from its parent's router
hash), so a request's pages, hashed by ``prefix.chain_token_hashes`` with the same page
size, are looked up directly. It keeps, per worker, engine hash -> router hash and the set of
router hashes held per medium (GPU, CPU_PINNED, ...). Pages it cannot place (unknown parent,
partial or bigram pages, LoRA or cache-salt namespaces) are skipped: the index may hold
less than the engine, never more. Pure: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from router.prefix import next_token_hash


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    attn_dp_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)
GPU = "GPU"


class _Worker:
    __slots__ = ("held", "router_of")

    def __init__(self) -> None:
        self.router_of: dict[int, int] = {}  # engine hash -> router hash
        self.held: dict[str, set[int]] = {}  # medium -> router hashes


class ExactIndex:
    def __init__(self, page_tokens: int, max_pages_per_worker: int = 1_000_000) -> None:
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be > 0, got {page_tokens}")
        self.page_tokens = page_tokens
        self.max_pages = max_pages_per_worker
        self._w: dict[str, _Worker] = {}
        self.skipped = 0  # pages not placed (see the module docstring)
        self.page_size_mismatch = 0  # pages of another size than page_tokens: a misconfiguration

    def __repr__(self) -> str:
        return f"ExactIndex(page_tokens={self.page_tokens}, pages={ {w: self.size(w) for w in self._w} })"

    def size(self, worker: str, medium: str | None = None) -> int:
        w = self._w.get(worker)
        if w is None:
            return 0
        if medium is not None:
            return len(w.held.get(medium, ()))
        return len(set().union(*w.held.values())) if w.held else 0

    def clear(self, worker: str) -> None:
        self._w.pop(worker, None)

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        w = self._w.setdefault(worker, _Worker())
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(w, ev)
            elif isinstance(ev, BlockRemoved):
                self._remove(w, ev)
            else:
                w.router_of.clear()
                w.held.clear()
        if len(w.router_of) > self.max_pages:
            self.clear(worker)  # over the bound: forget it all (a miss is always fine)

    def _store(self, w: _Worker, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        p = self.page_tokens
        if ev.lora_name is not None or ev.cache_salt is not None or ev.lora_id is not None:
            self.skipped += n  # namespaced pages never match a plain request
            return
        if ev.block_size != p and not (n == 1 and ev.block_size < p):
            self.page_size_mismatch += n  # the engine's page size is not the configured one
            return
        full = min(n, len(ev.token_ids) // p)  # a coalesced chain may end in a partial page
        self.skipped += n - full
        if ev.parent_block_hash is None:
            prev = 0
        else:
            parent = w.router_of.get(ev.parent_block_hash)
            if parent is None:
                self.skipped += full
                return
            prev = parent
        held = w.held.setdefault(ev.medium or GPU, set())
        for i in range(full):
            page = ev.token_ids[i * p : (i + 1) * p]
            if not isinstance(page[0], int):
                self.skipped += full - i  # bigram pages
                return
            prev = next_token_hash(prev, page)
            w.router_of[ev.block_hashes[i]] = prev
            held.add(prev)

    def _remove(self, w: _Worker, ev: BlockRemoved) -> None:
        medium = ev.medium or GPU
        held = w.held.get(medium)
        for eh in ev.block_hashes:
            rh = w.router_of.get(eh)
            if rh is None:
                continue
            if held is not None:
                held.discard(rh)
            if not any(rh in s for s in w.held.values()):
                del w.router_of[eh]

    def match(self, worker: str, page_hashes: Sequence[int]) -> int:
        """Leading pages of the request the worker holds in any medium."""
        w = self._w.get(worker)
        if w is None or not w.held:
            return 0
        sets = list(w.held.values())
        n = 0
        for h in page_hashes:
            if not any(h in s for s in sets):
                break
            n += 1
        return n
