"""Every eviction policy by its kind (gcache.tier.eviction, gcache.tier.slru)."""

from __future__ import annotations

from gcache.tier.eviction import (
    EvictionConfig,
    EvictionKind,
    EvictionPolicy,
    LruPolicy,
    ReusePolicy,
    S3FifoPolicy,
)
from gcache.tier.slru import SlruPolicy

POLICIES: dict[EvictionKind, type[EvictionPolicy]] = {
    p.kind: p for p in (LruPolicy, ReusePolicy, S3FifoPolicy, SlruPolicy)}


def make_policy(config: EvictionConfig, capacity: int) -> EvictionPolicy:
    """The policy ``config.kind`` for ``capacity`` bytes."""
    return POLICIES[config.kind](config, capacity)
