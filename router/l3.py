"""How much of a prompt's prefix any worker can load from the shared L3 tier (gcache).

SGLang's HiCache backend for gcache (``sglang_adapter``) stores page ``i`` of a sequence
under ``{page_hash}.kv@{shard}#{format}`` in its gcache namespace, where page hashes are SGLang's
storage chain: SHA-256 over the previous page's digest and the page's token ids as
little-endian uint32 (uint64 after a 0xff tag when a token does not fit), hex-encoded.
``sglang_page_hashes`` recomputes that chain; ``L3Probe`` asks gcache, in one batched
``exists``, which of a request's pages are stored and answers the leading run in tokens.
Every worker of the fleet shares the tier, so the answer is the same for all of them.
A failed or slow gcache is a miss (0 tokens), never an error for the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("gcache.router.l3")

_U32_MAX = 0xFFFFFFFF


def sglang_page_hashes(token_ids: Sequence[int], page_tokens: int, max_pages: int | None = None) -> list[str]:
    """SGLang's HiCache storage page keys (``get_hash_str`` with no namespace) of every full page."""
    n = len(token_ids) // page_tokens
    if max_pages is not None:
        n = min(n, max_pages)
    if n == 0:
        return []
    arr = np.asarray(token_ids[: n * page_tokens], dtype=np.int64)
    out: list[str] = []
    prior = b""
    step = page_tokens
    narrow = arr.astype(np.uint32).tobytes() if arr.max(initial=0) <= _U32_MAX else None
    for i in range(n):
        if narrow is not None:
            data = narrow[i * step * 4 : (i + 1) * step * 4]
        else:
            page = arr[i * step : (i + 1) * step]
            data = (b"\xff" + page.astype("<u8").tobytes()) if page.max() > _U32_MAX else \
                page.astype("<u4").tobytes()
        d = hashlib.sha256(prior + data).digest()
        out.append(d.hex())
        prior = d
    return out


@dataclass(frozen=True)
class L3Config:
    """nodes: the gcache cluster (daemon HOST:PORT list, or ``gcache://`` masters);
    namespace: the namespace the engines' HiCache backend writes (default "sglang");
    shard: what follows ``@`` in the engines' KV page keys: their shard and page format
    (``GCacheStorage.l3_shard()``, which the backend also logs, e.g.
    ``Qwen%2FQwen3-8B_tp0of1#9f2c...``; any one TP rank's pages stand for all);
    timeout_s: the longest a request waits for the answer; max_pages: pages asked about at most."""

    nodes: tuple[str, ...]
    shard: str
    namespace: str = "sglang"
    timeout_s: float = 0.05
    max_pages: int = 4096

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ValueError("L3 needs the gcache nodes (HOST:PORT,... or gcache://MASTERS)")
        if not self.shard:
            raise ValueError("L3 needs the engines' KV shard: what follows '@' in their page keys, as the "
                             "gcache HiCache backend logs it (e.g. Qwen%2FQwen3-8B_tp0of1#9f2c...)")
        if not self.timeout_s > 0 or self.max_pages <= 0:
            raise ValueError("L3 timeout_s and max_pages must be > 0")


class L3Probe:
    def __init__(self, cfg: L3Config, page_tokens: int) -> None:
        from gcache.client import Client  # the router needs gcache only when L3 is configured
        from gcache.client.client import OnNodeError

        if page_tokens <= 0:
            raise ValueError("L3 awareness needs the engines' page size (--page-size)")
        self.cfg = cfg
        self.page_tokens = page_tokens
        nodes = cfg.nodes[0] if len(cfg.nodes) == 1 and cfg.nodes[0].startswith("gcache://") else list(cfg.nodes)
        self.client = Client(nodes, namespace=cfg.namespace, timeout_s=cfg.timeout_s,
                             connect_timeout_s=cfg.timeout_s, on_node_error=OnNodeError.MISS)
        self._suffix = f".kv@{cfg.shard}".encode()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="l3-exists")
        self.queries = 0
        self.failures = 0

    def __repr__(self) -> str:
        return f"L3Probe(ns={self.cfg.namespace!r}, shard={self.cfg.shard!r}, queries={self.queries})"

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        hashes = sglang_page_hashes(token_ids, self.page_tokens, self.cfg.max_pages)
        return [h.encode() + self._suffix for h in hashes]

    def _leading(self, keys: list[bytes]) -> int:
        n = 0
        for hit in self.client.exists(keys):
            if not hit:
                break
            n += 1
        return n

    async def loadable_tokens(self, token_ids: Sequence[int] | None) -> int:
        """Leading prompt tokens stored in L3 (0 on any failure or timeout)."""
        if not token_ids:
            return 0
        keys = self.keys(token_ids)
        if not keys:
            return 0
        self.queries += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.cfg.timeout_s * 4):
                pages = await loop.run_in_executor(self._pool, self._leading, keys)
        except Exception as e:  # noqa: BLE001 - any failure of the L3 tier is a miss
            self.failures += 1
            log.debug("L3 exists failed: %s: %s", type(e).__name__, e)
            return 0
        return pages * self.page_tokens

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()
