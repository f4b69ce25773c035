"""The adapter's configuration, read once from SGLang's ``--hicache-storage-backend-extra-config``.

Recognised keys (all optional; the cluster may instead come from $GCACHE_MASTERS or $GCACHE_NODES,
see gcache.env)::

    "nodes":            ["127.0.0.1:7400", ...] or "h1:p1,h2:p2" (a static cluster), or
                        "gcache://m1:p1,m2:p2" (the master group: routing follows its membership)
    "masters":          "gcache://m1:p1,m2:p2" (same as a gcache:// "nodes")
    "token_file":       cluster token file (else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN)
    "namespace":        gcache namespace (default "sglang")
    "timeout_s":        per-batch deadline; a dead daemon turns into misses within it (default 1.0)
    "connect_timeout_s": (default 0.3)
    "dual_pools":       true (default): SWA pages go to their own daemon pool ("swa"), with its
                        own budget; false: every page is tagged "kv" (one pool, for comparison)
    "skip_existing":    true (default): a backup asks which pages exist and sends only the rest
    "local":            "auto" | "off" | "force": the same-host shared-memory path (default "auto")
    "config":           a gcache.toml whose [sglang] section gives defaults for these keys
                        (else $GCACHE_CONFIG, when set)

Keys SGLang itself reads from the same object are accepted and ignored here: the factory's
(``backend_name``, ``module_path``, ``class_name``), ``interface_v1``, the prefetch settings
(``prefetch_threshold``, ``prefetch_timeout_base``, ``prefetch_timeout_per_ki_token``),
``hicache_storage_pass_prefix_keys`` and ``tp_lcm_size``. Any other key is refused with an error
naming the known ones (a misspelt "namespace" would otherwise share the default namespace).
``timeout_s`` and ``connect_timeout_s`` are numbers of seconds > 0 and at most a day (not true/false).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gcache.client.config import MAX_TIMEOUT_S, LocalPath, timeout_error
from gcache.env import resolve_cluster, resolve_token
from gcache.errors import ConfigError

#: the adapter's own keys
KEYS = ("nodes", "masters", "token_file", "namespace", "timeout_s", "connect_timeout_s", "dual_pools",
        "skip_existing", "local", "config")
#: keys SGLang reads from the same extra_config (the dynamic backend factory, HiCacheController,
#: HybridCacheController.parse_storage_backend_extra_config); accepted, not used here
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size")


def finite_seconds(value: Any) -> bool:
    """Whether ``value`` is a number of seconds a deadline can be made of: an int or a float (not
    a bool), > 0 and at most the client's MAX_TIMEOUT_S (inf, or ~25 days, overflows every wait;
    NaN compares false with everything)."""
    return timeout_error("", value) is None


def write_deadlines(timeout_s: float) -> tuple[float, float]:
    """time.monotonic() deadlines of a write that first asks which keys exist, then puts the rest:
    (existence round, put round), both within one ``timeout_s`` from now. The existence round
    gets the first half (it takes milliseconds unless an owner hangs), so a hung owner costs
    the write at most ``timeout_s`` in all and the other owners' puts still have the rest."""
    now = time.monotonic()
    return now + timeout_s / 2, now + timeout_s


@dataclass(frozen=True)
class AdapterConfig:
    """``nodes``: daemon HOST:PORTs (a static cluster), or empty with ``masters`` set."""

    nodes: tuple[str, ...]
    namespace: str = "sglang"
    timeout_s: float = 1.0
    connect_timeout_s: float = 0.3
    dual_pools: bool = True
    skip_existing: bool = True
    masters: str | None = None
    token_file: str | None = None
    local: LocalPath = LocalPath.AUTO

    def __post_init__(self) -> None:
        if not self.nodes and not self.masters:
            raise ConfigError("gcache adapter: no cluster; set extra_config 'nodes' (HOST:PORT list or "
                              "gcache://masters) or $GCACHE_MASTERS / $GCACHE_NODES")
        for name in ("timeout_s", "connect_timeout_s"):
            if not finite_seconds(getattr(self, name)):
                raise ConfigError(f"gcache adapter: {name!r} must be a finite number of seconds > 0 "
                                  f"and at most {MAX_TIMEOUT_S:g}, "
                                  f"got {getattr(self, name)!r}")

    def target(self) -> str | list[str]:
        """What the gcache Client is given: the master URL, else the node list."""
        return self.masters if self.masters else list(self.nodes)

    def token(self) -> str | None:
        return resolve_token(self.token_file)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None, read_file: bool = True) -> AdapterConfig:
        extra = dict(extra or {})
        path = extra.pop("config", None) or (os.environ.get("GCACHE_CONFIG") if read_file else None)
        if path and read_file:  # a gcache.toml's [sglang] section; extra_config keys win
            from gcache.ops.config import load

            extra = {**load(path).get("sglang", {}), **extra}
        unknown = sorted(k for k in extra if k not in KEYS and k not in SGLANG_KEYS)
        if unknown:
            raise ConfigError(f"gcache adapter: unknown extra_config key(s) {unknown}; the adapter's keys are "
                              f"{list(KEYS)} (SGLang's own {list(SGLANG_KEYS)} are accepted too)")
        nodes = extra.get("nodes")
        if nodes is not None and not isinstance(nodes, str) and (
                not isinstance(nodes, (list, tuple)) or not all(isinstance(n, str) for n in nodes)):
            raise ConfigError(f"gcache adapter: 'nodes' must be a list of HOST:PORT or a gcache:// URL, got {nodes!r}")
        masters = extra.get("masters")
        if masters is not None and not isinstance(masters, str):
            raise ConfigError(f"gcache adapter: 'masters' must be a gcache:// URL, got {masters!r}")
        if nodes and masters:  # (one would be ignored: say so instead)
            raise ConfigError("gcache adapter: give 'nodes' or 'masters', not both")
        try:
            target = resolve_cluster(nodes or None, masters)
        except ConfigError as exc:
            raise ConfigError(f"gcache adapter: {exc}") from None
        kwargs: dict[str, Any] = {}
        if isinstance(target, str):
            kwargs["masters"] = target
        for name, typ in (("namespace", str), ("timeout_s", (int, float)), ("connect_timeout_s", (int, float)),
                          ("dual_pools", bool), ("skip_existing", bool), ("token_file", str), ("local", str)):
            if name in extra:
                if not isinstance(extra[name], typ) or (typ is not bool and isinstance(extra[name], bool)):
                    raise ConfigError(f"gcache adapter: {name!r} has the wrong type: {extra[name]!r}")
                kwargs[name] = extra[name]
        if "local" in kwargs:
            try:
                kwargs["local"] = LocalPath(kwargs["local"])
            except ValueError:
                raise ConfigError(f"gcache adapter: 'local' must be auto, off or force, got {kwargs['local']!r}") from None
        return cls(nodes=() if isinstance(target, str) else tuple(target), **kwargs)
