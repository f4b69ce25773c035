"""gcache key naming for SGLang pages (pure).

SGLang page keys are chained SHA-256 hex digests of the page tokens. A stored object is one
page of one host pool on one shard in one byte format: ``{page_hash}.{pool}@{shard}#{format}``.

* The shard names the model (``%``, ``/``, ``_`` and ``~`` percent-encoded: ``a/b-c`` and ``a-b/c``
  stay two names, and the first ``_`` of a shard always ends the name, so a model called
  ``org/m_pp0of2`` is never taken for ``org/m`` at pipeline stage 0 of 2; a name too long for
  a key is shortened with a digest), the TP rank and size
  (MLA models keep one copy shared by every rank, so their KV and its replicated side pools
  omit the rank; a Mamba pool, or an MHA draft pool, holds per-rank bytes and keeps it;
  KeyScheme.rank_sharded), the
  pipeline stage, the context-parallel rank and the decode context-parallel rank (each holds
  other tokens of a page).
* The format (``page_format``) is a digest of everything that decides how a page's bytes are
  laid out or what they mean: the key format version, the host pool's class, its layout
  (page_first, page_first_direct, layer_first), dtype, tokens per page, the byte size of each
  buffer a page is made of, and ``extra``: what the host pool does not show (its layer range,
  a Mamba pool's SSM state dtype, and the deployment identity from SGLang's server arguments:
  the logical KV cache dtype, which for every fp8 variant is stored as uint8, the weights'
  quantization and scales, the checkpoint loaded (model path, revision, load format: "dummy"
  is random weights), config overrides and a speculative draft's algorithm, checkpoint,
  revision, load format, quantization and KV cache dtype; sglang_adapter.pages.IDENTITY_ARGS). Two deployments that differ in any of these never share a key, so a
  reader gets a miss, never another layout's bytes.

Together: no two writers of different bytes share a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

#: Bump when the meaning of a stored page's bytes or of its key changes: older pages then become
#: misses (3: ``_`` escaped in the model name; without the bump an older page of a model named
#: ``org/m_pp0of2`` would be read as one of ``org/m`` at pipeline stage 0 of 2. 4: the load
#: format, a restored ModelOpt checkpoint, KTransformers' CPU expert weights, a draft's load
#: format and more (sglang_adapter.pages.IDENTITY_ARGS) joined the deployment identity; without
#: the bump a page written with random "dummy" weights under the old identity would be read by
#: a deployment loading the real ones).
FORMAT_VERSION = 4


def page_format(pool_class: str, layout: str, dtype: str, page_size: int, buffer_sizes: Sequence[int],
                extra: Sequence[str] = ()) -> str:
    """A short digest naming the byte format of one page (see the module docstring). The fields
    are joined with ``|``, each with its ``\\`` and ``|`` escaped, so no field's value can pass
    for a field boundary (a model path ``/m|revision=v2`` is not ``/m`` at revision v2); a field
    without either character is as it was before the escaping, and so is its digest."""
    fields = [f"v{FORMAT_VERSION}", pool_class, layout, dtype, str(page_size), ",".join(map(str, buffer_sizes)),
              *extra]
    desc = "|".join(f.replace("\\", "\\\\").replace("|", "\\|") for f in fields)
    return xxhash.xxh3_64_hexdigest(desc.encode())


#: longest model name kept as it is in a key; a longer one (keys are at most
#: gcache.protocol.MAX_KEY_BYTES) is shortened to its first MODEL_HEAD bytes, ``~`` and a digest
MODEL_NAME_MAX = 640  # (a key also holds the page hash, pool, shard fields and format: ~150 bytes)
MODEL_HEAD = 64


def model_name(name: str) -> str:
    """A model name as a key part: ``%``, ``/``, ``_`` and ``~`` percent-encoded (reversible, so
    two names never meet; without ``_`` the name never runs into the shard's ``_tp``/``_pp``/...
    fields after it). A name longer than MODEL_NAME_MAX becomes its head, ``~`` and a 128-bit
    digest of the whole name (``~`` appears in no encoded name, so no short name meets it)."""
    enc = name.replace("%", "%25").replace("/", "%2F").replace("_", "%5F").replace("~", "%7E")
    if len(enc.encode()) <= MODEL_NAME_MAX:
        return enc
    head = enc.encode()[:MODEL_HEAD].decode(errors="ignore")
    return f"{head}~{xxhash.xxh3_128_hexdigest(name.encode())}"


#: pools whose pages each TP rank holds its own part of even in an MLA model (SGLang backs them
#: up on every rank: HybridCacheController.should_backup)
RANK_SHARDED_POOLS = frozenset({"mamba"})


@dataclass(frozen=True)
class KeyScheme:
    model: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    is_mla: bool = False
    dcp_rank: int = 0
    dcp_size: int = 1

    @classmethod
    def from_storage_config(cls, cfg: Any) -> KeyScheme:
        return cls(
            model=model_name(cfg.model_name or ""),
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size,
            pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            cp_rank=getattr(cfg, "attn_cp_rank", 0), cp_size=getattr(cfg, "attn_cp_size", 1),
            is_mla=bool(cfg.is_mla_model),
            dcp_rank=getattr(cfg, "dcp_rank", 0) or 0, dcp_size=getattr(cfg, "dcp_size", 1) or 1,
        )

    def rank_sharded(self, pool: str) -> bool:
        """Whether each TP rank holds its own bytes of ``pool``'s pages, by the pool's name alone:
        every pool of an MHA model; in an MLA model only a Mamba pool (its state is split over
        the ranks). MLA KV and its side pools (DSA indexer, DeepSeek-V4's compressed pools, an
        MLA draft) are replicated: every rank holds the same bytes, and SGLang backs them up on
        the storage writer (TP rank 0) only, so they must be keyed without the rank for the other
        ranks to find them. A side pool of an MLA model that is an MHA pool (an MHA draft: heads
        split over the ranks) is rank-sharded too; the caller, who sees the pool, says so."""
        return not self.is_mla or pool in RANK_SHARDED_POOLS

    def shard(self, pool: str, rank_sharded: bool | None = None) -> str:
        """Per TP rank where ``rank_sharded`` (default: rank_sharded(pool)), rank-shared
        otherwise. Every field starts with ``_``, which the model name (model_name) never
        contains."""
        s = self.model
        if self.rank_sharded(pool) if rank_sharded is None else rank_sharded:
            s += f"_tp{self.tp_rank}of{self.tp_size}"
        if self.pp_size > 1:
            s += f"_pp{self.pp_rank}of{self.pp_size}"
        if self.cp_size > 1:
            s += f"_cp{self.cp_rank}of{self.cp_size}"
        if self.dcp_size > 1:
            s += f"_dcp{self.dcp_rank}of{self.dcp_size}"
        return s

    def key(self, page_hash: str, pool: str, fmt: str = "", rank_sharded: bool | None = None) -> bytes:
        return self.keys([page_hash], pool, fmt, rank_sharded)[0]

    def keys(self, page_hashes: list[str], pool: str, fmt: str = "", rank_sharded: bool | None = None) -> list[bytes]:
        """``fmt``: the page format (page_format) of the host pool the pages live in;
        ``rank_sharded``: see shard."""
        suffix = f".{pool}@{self.shard(pool, rank_sharded)}" + (f"#{fmt}" if fmt else "")
        return [(h + suffix).encode() for h in page_hashes]
