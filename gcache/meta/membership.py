"""Cluster membership as the client sees it: an epoch and the nodes that own ring ranges."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gcache.errors import ConfigError
from gcache.meta.ring import HashRing, RingParams
from gcache.net.address import address_error


class NodeState(enum.Enum):
    UP = "up"
    SUSPECT = "suspect"
    DOWN = "down"
    DRAINING = "draining"


@dataclass(frozen=True)
class Node:
    """A daemon: ``node_id`` is stable across restarts; ``address`` is its data-plane HOST:PORT;
    ``weight`` scales its share of the ring (capacity relative to a standard node)."""

    node_id: str
    address: str
    weight: float = 1.0
    state: NodeState = NodeState.UP

    def __post_init__(self) -> None:
        err = address_error(self.address)
        if err:
            raise ConfigError(f"node {self.node_id!r}: {err}")
        if not self.weight > 0:
            raise ConfigError(f"node {self.node_id!r}: weight must be > 0")


@dataclass(frozen=True)
class Membership:
    """``previous``: while a handover is in progress, the owners from before the change that
    opened it; a client falls back to them on a miss. ``ring`` / ``previous_ring``: the ring
    parameters the master published with them (None: fitted to the owners, as a static cluster
    does), so that every client and daemon builds the same ring."""

    epoch: int
    nodes: tuple[Node, ...] = field(default_factory=tuple)
    previous: tuple[Node, ...] | None = None
    ring: RingParams | None = None
    previous_ring: RingParams | None = None
    ring_gen: int = 0  # the masters' count of ring changes (NodeTable.ring_gen)

    @classmethod
    def from_master(cls, m: dict[str, Any]) -> Membership:
        """From the master's published form (gcache.meta.nodetable.NodeTable.membership)."""
        nodes = tuple(Node(r["id"], r["address"], float(r["weight"]), NodeState(r["state"])) for r in m["nodes"])
        t = m.get("transition")
        prev = tuple(Node(r["id"], r["address"], float(r["weight"])) for r in t["from"]) if t else None
        ring = RingParams.from_wire(m["ring"]) if m.get("ring") else None
        prev_ring = RingParams.from_wire(t["ring"]) if t and t.get("ring") else None
        return cls(int(m["epoch"]), nodes, prev, ring, prev_ring, int(m.get("ring_gen") or 0))

    @classmethod
    def from_addresses(cls, addresses: Iterable[str], epoch: int = 0) -> Membership:
        """Equal-weight nodes whose ids are their addresses (a static cluster)."""
        nodes = tuple(Node(a.strip(), a.strip()) for a in addresses if a.strip())
        if not nodes:
            raise ConfigError("no nodes given; pass at least one HOST:PORT")
        if len({n.node_id for n in nodes}) != len(nodes):
            raise ConfigError("duplicate node addresses")
        return cls(epoch, nodes)

    def build_ring(self) -> HashRing | None:
        """The ring of the owners (None when nothing owns keys). Costs up to ~50 ms: build it
        once per epoch, off any hot path."""
        owners = self.owners()
        return HashRing({nid: n.weight for nid, n in owners.items()}, self.ring) if owners else None

    def build_previous_ring(self) -> HashRing | None:
        """The ring of the owners before the open handover (None when there is none)."""
        if not self.previous:
            return None
        return HashRing({n.node_id: n.weight for n in self.previous}, self.previous_ring)

    def owners(self) -> dict[str, Node]:
        """Nodes that own ring ranges (UP and SUSPECT; DOWN and DRAINING own nothing)."""
        return {n.node_id: n for n in self.nodes if n.state in (NodeState.UP, NodeState.SUSPECT)}
