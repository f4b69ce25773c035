"""The adapter's configuration, read once from SGLang's ``--hicache-storage-backend-extra-config``.

Recognised keys (all optional except a node list, which may instead come from $GCACHE_NODES)::

    "nodes":            ["127.0.0.1:7400", ...] or "h1:p1,h2:p2"
    "namespace":        gcache namespace (default "sglang")
    "timeout_s":        per-batch deadline; a dead daemon turns into misses within it (default 1.0)
    "connect_timeout_s": (default 0.3)
    "dual_pools":       true (default): SWA pages go to their own daemon pool ("swa"), with its
                        own budget; false: every page is tagged "kv" (one pool, for comparison)
    "skip_existing":    true (default): a backup asks which pages exist and sends only the rest
    "config":           a gcache.toml whose [sglang] section gives defaults for these keys
                        (else $GCACHE_CONFIG, when set)

Factory keys (``backend_name``, ``module_path``, ``class_name``, ``interface_v1``) are ignored here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcache.errors import ConfigError


@dataclass(frozen=True)
class AdapterConfig:
    nodes: tuple[str, ...]
    namespace: str = "sglang"
    timeout_s: float = 1.0
    connect_timeout_s: float = 0.3
    dual_pools: bool = True
    skip_existing: bool = True

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("gcache adapter: no nodes; set extra_config 'nodes' or $GCACHE_NODES")
        if not self.timeout_s > 0 or not self.connect_timeout_s > 0:
            raise ConfigError("gcache adapter: timeout_s and connect_timeout_s must be > 0")

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, read_file: bool = True) -> AdapterConfig:
        extra = dict(extra or {})
        path = extra.pop("config", None) or (os.environ.get("GCACHE_CONFIG") if read_file else None)
        if path and read_file:  # a gcache.toml's [sglang] section; extra_config keys win
            from gcache.ops.config import load

            extra = {**load(path).get("sglang", {}), **extra}
        nodes = extra.get("nodes") or os.environ.get("GCACHE_NODES", "")
        if isinstance(nodes, str):
            nodes = [n.strip() for n in nodes.split(",") if n.strip()]
        if not isinstance(nodes, (list, tuple)) or not all(isinstance(n, str) for n in nodes):
            raise ConfigError(f"gcache adapter: 'nodes' must be a list of HOST:PORT, got {nodes!r}")
        kwargs: dict[str, Any] = {}
        for name, typ in (("namespace", str), ("timeout_s", (int, float)), ("connect_timeout_s", (int, float)),
                          ("dual_pools", bool), ("skip_existing", bool)):
            if name in extra:
                if not isinstance(extra[name], typ):
                    raise ConfigError(f"gcache adapter: {name!r} has the wrong type: {extra[name]!r}")
                kwargs[name] = extra[name]
        return cls(nodes=tuple(nodes), **kwargs)
