"""Configuration and key naming of the gcache embedding store (pure: no sglang, no sockets).

SGLang 0.5.23 creates an embedding store with no arguments (``EmbeddingStoreFactory.
create_backend(name)``), so the store reads one JSON object, from its ``storage_config``
argument when given, else from ``$GCACHE_EMB_CONFIG`` (the launcher's ``--gcache-emb-config``
sets it)::

    "nodes":             ["127.0.0.1:7400", ...] or "h1:p1,h2:p2" (default $GCACHE_NODES)
    "model":             the model the embeddings belong to (default: SGLang's served model name,
                         else its --model-path); part of every key
    "namespace":         gcache namespace (default "sglang-emb")
    "pool":              daemon pool the embeddings go to; give it a budget with
                         ``gcache daemon --pool-budget emb=SIZE`` (default "emb")
    "timeout_s":         per-batch deadline; a dead daemon is a miss within it (default 1.0)
    "connect_timeout_s": (default 0.3)
    "skip_existing":     a put first asks which embeddings exist and sends only the rest (default true)
    "local":             "auto" | "off" | "force": the same-host shared-memory path (default "auto")
    "token_file":        cluster token file (else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN)

Keys are self-describing:
``{mm_hash}.emb.{modality}@{model}#{dtype}x{hidden}.{identity}.v{FORMAT_VERSION}``, where
``identity`` is a digest of what SGLang's server arguments say about the model's output
(sglang_adapter.pages.model_identity: the checkpoint loaded, its revision, load format, dtype,
quantization, config overrides, multimodal preprocessing...; the same arguments are part of
the KV pages' identity). An embedding written by a deployment of another model, checkpoint,
weights, dtype or hidden size, or in an older format, has another key, so a reader gets a
miss, never bytes it would misread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from gcache.client.client import LocalPath
from gcache.client.config import MAX_TIMEOUT_S
from gcache.env import resolve_token
from gcache.errors import ConfigError
from sglang_adapter.config import finite_seconds

#: Bump when the meaning of a stored embedding's bytes or of its key changes: older ones become
#: misses (2: the model identity joined the key; without the bump an embedding written under one
#: served name by another checkpoint, or by random "dummy" weights, would still be read).
FORMAT_VERSION = 2
ENV_CONFIG = "GCACHE_EMB_CONFIG"
_MAX_MODEL_BYTES = 512  # leaves room in gcache's 1 KiB keys for a 64-hex content hash and the format


@dataclass(frozen=True)
class EmbeddingFormat:
    """How one embedding's bytes are laid out: ``num_tokens`` rows of ``hidden`` values of
    ``dtype`` (a torch dtype name without the ``torch.`` prefix), of one modality pool."""

    modality: str
    dtype: str
    hidden: int

    def __post_init__(self) -> None:
        if not self.modality or not self.dtype or self.hidden <= 0:
            raise ConfigError(f"embedding format needs a modality, a dtype and a hidden size > 0: {self}")



def identity_tag(identity: Sequence[str] = ()) -> str:
    """A short digest of a deployment's model identity (``name=value`` strings,
    sglang_adapter.pages.model_identity), the same for every writer and reader that agree."""
    return xxhash.xxh3_64_hexdigest("|".join(identity).encode())


#: what a content hash or a model name must not hold: the key's own separators (with them a model
#: name and a hash could together spell another deployment's key)
KEY_SEPARATORS = (".", "@", "#")


def hash_ok(h: object) -> bool:
    """Whether ``h`` can be an embedding's content hash in a key: a non-empty string of UTF-8
    without the key's separators (SGLang's are decimal or hex digits)."""
    if not isinstance(h, str) or not h or any(c in h for c in KEY_SEPARATORS):
        return False
    try:
        h.encode()
    except UnicodeEncodeError:
        return False
    return True


def embedding_keys(hashes: list[str], model: str, fmt: EmbeddingFormat, identity: str = "") -> list[bytes]:
    """gcache keys of the embeddings of ``hashes`` (content hashes) in format ``fmt``, written by
    a deployment whose model identity has the digest ``identity`` (identity_tag; default: none)."""
    suffix = f".emb.{fmt.modality}@{model}#{fmt.dtype}x{fmt.hidden}.{identity or identity_tag()}.v{FORMAT_VERSION}"
    return [(h + suffix).encode() for h in hashes]


@dataclass(frozen=True)
class EmbeddingStoreConfig:
    nodes: tuple[str, ...]
    model: str
    namespace: str = "sglang-emb"
    pool: str = "emb"
    timeout_s: float = 1.0
    connect_timeout_s: float = 0.3
    skip_existing: bool = True
    local: LocalPath = LocalPath.AUTO
    token_file: str | None = None

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("gcache embedding store: no nodes; set 'nodes' in the config or $GCACHE_NODES")
        if not self.model:
            raise ConfigError("gcache embedding store: no model name; set 'model' in the config "
                              f"(${ENV_CONFIG}) or run inside SGLang, which publishes it")
        if any(sep in self.model for sep in ("@", "#", ".emb.")):
            raise ConfigError(f"gcache embedding store: model name {self.model!r} holds '@', '#' or '.emb.', "
                              "which separate the parts of a key")
        if len(self.model.encode()) > _MAX_MODEL_BYTES:
            raise ConfigError(f"gcache embedding store: model name longer than {_MAX_MODEL_BYTES} bytes")
        for name in ("timeout_s", "connect_timeout_s"):
            if not finite_seconds(getattr(self, name)):
                raise ConfigError(f"gcache embedding store: {name!r} must be a finite number of seconds > 0 "
                                  f"and at most {MAX_TIMEOUT_S:g}, "
                                  f"got {getattr(self, name)!r}")
        if not self.pool:
            raise ConfigError("gcache embedding store: 'pool' must not be empty")

    @classmethod
    def load(cls, config: Mapping[str, Any] | str | None, default_model: str = "") -> EmbeddingStoreConfig:
        """From ``config`` (a mapping or a JSON object), else from ``$GCACHE_EMB_CONFIG``; the
        node list defaults to ``$GCACHE_NODES`` and the model to ``default_model``."""
        if config is None:
            config = os.environ.get(ENV_CONFIG) or {}
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as exc:
                raise ConfigError(f"gcache embedding store: config is not JSON: {exc}") from None
        if not isinstance(config, Mapping):
            raise ConfigError(f"gcache embedding store: config must be a JSON object, got {config!r}")
        extra = dict(config)
        unknown = set(extra) - {"nodes", "model", "namespace", "pool", "timeout_s", "connect_timeout_s",
                                "skip_existing", "local", "token_file"}
        if unknown:
            raise ConfigError(f"gcache embedding store: unknown config keys {sorted(unknown)}")
        nodes = extra.pop("nodes", None) or os.environ.get("GCACHE_NODES", "")
        if isinstance(nodes, str):
            nodes = [n.strip() for n in nodes.split(",") if n.strip()]
        if not isinstance(nodes, (list, tuple)) or not all(isinstance(n, str) for n in nodes):
            raise ConfigError(f"gcache embedding store: 'nodes' must be a list of HOST:PORT, got {nodes!r}")
        kwargs: dict[str, Any] = {}
        for name, typ in (("model", str), ("namespace", str), ("pool", str), ("timeout_s", (int, float)),
                          ("connect_timeout_s", (int, float)), ("skip_existing", bool), ("local", str),
                          ("token_file", str)):
            if name in extra:
                if not isinstance(extra[name], typ) or (typ != bool and isinstance(extra[name], bool)):
                    raise ConfigError(f"gcache embedding store: {name!r} has the wrong type: {extra[name]!r}")
                kwargs[name] = extra[name]
        if "local" in kwargs:
            try:
                kwargs["local"] = LocalPath(kwargs["local"])
            except ValueError:
                raise ConfigError(f"gcache embedding store: 'local' must be auto, off or force, "
                                  f"got {kwargs['local']!r}") from None
        kwargs.setdefault("model", default_model)
        return cls(nodes=tuple(nodes), **kwargs)

    def token(self) -> str | None:
        """The cluster token: ``token_file``, else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN."""
        return resolve_token(self.token_file)
