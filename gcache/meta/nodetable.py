"""The master's replicated state: the node table and the membership epoch (pure, no I/O).

Every change goes through ``apply(command)``; commands are versioned msgpack maps, applied in
the same order on every master by Raft, so every master holds the same table. Time never enters
the state: heartbeats and failure detection live outside it, and the leader turns what it
observes into ``set_state`` commands.

States: UP and SUSPECT nodes own ring ranges; DOWN and DRAINING nodes own none. A change that
moves ranges away from live nodes (a join, a drain) opens a *transition*: the owners from before
the change stay listed so clients can fall back to them on a miss, until every node that must
hand keys over has reported ``handover_done`` for that epoch. The epoch moves with what clients
route by (owners, their ring, the transition opening or closing), not with each node's report.

The ring parameters (points per unit of weight) are part of the state too: refitted to the
owners at every change, with hysteresis, and published with the membership (and with the
transition's previous owners), so that every client and daemon builds the same ring.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgpack

from gcache.meta.ring import RingParams

COMMAND_VERSION = 1
GiB = 1 << 30
OWNING = ("up", "suspect")
STATES = ("up", "suspect", "down", "draining")
RING_HISTORY = 16  # rings kept for daemons that missed some (NodeTable.rings_after)


class CommandError(ValueError):
    """A command that cannot apply (unknown node, bad version...): the table is unchanged."""


def weight_for(capacity: int) -> float:
    """Ring weight from capacity (RAM + disk): one unit per GiB, at least 1."""
    return max(1.0, capacity / GiB)


class NodeTable:
    def __init__(self) -> None:
        self.epoch = 0
        # the first epoch of this table (its first register's base; 0: unknown, a table from a
        # version before it): a daemon registered at or after it that the table no longer knows
        # was removed from this table, i.e. drained, and must not register again (agent)
        self.born = 0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.transition: dict[str, Any] | None = None
        self.ring_unit = RingParams().unit
        # Moves with every change of the ring (owners, weights or ring parameters), not with other
        # epochs: a daemon that sees it jump by more than one missed a ring (gcache.server.agent).
        self.ring_gen = 0
        # the last RING_HISTORY rings by generation (derived from the commands, not in the
        # snapshot): a daemon that missed some rebuilds them to tell which keys moved meanwhile
        self.ring_history: deque[dict[str, Any]] = deque(maxlen=RING_HISTORY)

    # -- commands ---------------------------------------------------------------------------
    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("v") != COMMAND_VERSION:
            raise CommandError(f"command version {cmd.get('v')!r} not supported (speak {COMMAND_VERSION})")
        op = cmd.get("op")
        fn = getattr(self, f"_cmd_{op}", None) if isinstance(op, str) else None
        if fn is None:
            raise CommandError(f"unknown command {op!r}")
        out: dict[str, Any] = fn(cmd)
        return out

    def _cmd_register(self, cmd: dict[str, Any]) -> dict[str, Any]:
        node, address, capacity = cmd["node"], cmd["address"], int(cmd["capacity"])
        base = cmd.get("base")
        if isinstance(base, int) and base > 0 and self.epoch == 0 and not self.nodes:
            # a new table (the whole group started afresh: masters keep no state on disk)
            # numbers its epochs and rings from the proposer's clock, above those of any group
            # before it, whose daemons and clients drop a membership older than the one they hold
            self.epoch = self.ring_gen = self.born = base
        before = self._owners()
        old = self.nodes.get(node)
        inc = (old["inc"] if old else 0) + 1
        self.nodes[node] = {"id": node, "address": address, "capacity": capacity,
                            "weight": weight_for(capacity), "state": "up", "inc": inc}
        # every live previous owner may hold keys that now belong to the (re)joined node
        self._changed(before, {n for n in before if n != node})
        # "was": the state of the previous incarnation. Only if it still owned its ranges (up or
        # suspect) did no other node own them meanwhile, so only then may the daemon keep the data
        # it holds from before (gcache.server.agent).
        return {"inc": inc, "epoch": self.epoch, "was": old["state"] if old else None}

    def _cmd_set_state(self, cmd: dict[str, Any]) -> dict[str, Any]:
        rec = self._get(cmd["node"])
        if rec["inc"] != cmd["inc"] or rec["state"] == cmd["state"] or rec["state"] == "draining":
            return {"changed": False, "epoch": self.epoch}
        if cmd["state"] not in STATES:
            raise CommandError(f"unknown state {cmd['state']!r}")
        before = self._owners()
        rec["state"] = cmd["state"]
        rec.pop("down_at", None)
        if cmd["state"] == "down" and isinstance(cmd.get("at"), int):
            rec["down_at"] = cmd["at"]  # the proposer's wall clock, ms (gcache.meta.core: Register's "silent")
        self._changed(before, set())
        return {"changed": True, "epoch": self.epoch}

    def _cmd_drain(self, cmd: dict[str, Any]) -> dict[str, Any]:
        rec = self._get(cmd["node"])
        if rec["state"] == "draining":
            return {"epoch": self.epoch}
        if rec["state"] not in OWNING:
            raise CommandError(f"node {rec['id']} is {rec['state']}; only a live node can be drained")
        if len(self._owners()) < 2:
            raise CommandError("cannot drain the last node that owns keys")
        before = self._owners()
        rec["state"] = "draining"
        self._changed(before, {rec["id"]})
        return {"epoch": self.epoch}

    def _cmd_handover_done(self, cmd: dict[str, Any]) -> dict[str, Any]:
        t = self.transition
        node = cmd["node"]
        if t is None or cmd["epoch"] < t["epoch"] or node not in t["pending"]:
            return {"epoch": self.epoch, "closed": False}
        t["pending"].remove(node)
        left = self.nodes.get(node, {}).get("state") == "draining"
        if left:
            del self.nodes[node]  # drained: it leaves the cluster
        if not t["pending"]:
            self.transition = None
        # Only what clients route by moves the epoch: the transition closing, a node leaving. One
        # more node done is not news to them (the node learns it from its heartbeat replies), so
        # a join in a fleet of N nodes costs 2 epochs, not N.
        if left or self.transition is None:
            self.epoch += 1
        return {"epoch": self.epoch, "closed": self.transition is None}

    def _cmd_handover_done_many(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Several nodes' reports in one command (a master batches them: after a join every node
        reports, and one Raft entry per report would cost a large fleet dearly)."""
        results = [self._cmd_handover_done(r) for r in cmd["reports"]]
        return {"epoch": self.epoch, "results": results}

    def _cmd_remove(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self._get(cmd["node"])
        before = self._owners()
        del self.nodes[cmd["node"]]
        self._changed(before, set())
        return {"epoch": self.epoch}

    # -- helpers ----------------------------------------------------------------------------
    def _get(self, node: str) -> dict[str, Any]:
        rec = self.nodes.get(node)
        if rec is None:
            raise CommandError(f"unknown node {node!r}")
        return rec

    def _owners(self) -> dict[str, dict[str, Any]]:
        return {n: {"id": r["id"], "address": r["address"], "weight": r["weight"]}
                for n, r in self.nodes.items() if r["state"] in OWNING}

    def _changed(self, before: dict[str, dict[str, Any]], must_hand_over: set[str]) -> None:
        self.epoch += 1
        unit_before = self.ring_unit
        weights = {n: r["weight"] for n, r in self._owners().items()}
        self.ring_unit = RingParams.fit(list(weights.values()), unit_before).unit
        if self.ring_unit != unit_before or {n: r["weight"] for n, r in before.items()} != weights:
            self.ring_gen += 1
            self._record_ring(weights)
        live = {n for n, r in self.nodes.items() if r["state"] in OWNING or r["state"] == "draining"}
        if must_hand_over:
            pending = set(must_hand_over)
            if self.transition is not None:
                pending |= set(self.transition["pending"])
            self.transition = {"epoch": self.epoch, "from": sorted(before.values(), key=lambda r: r["id"]),
                               "ring": RingParams(unit_before).to_wire(), "pending": sorted(pending & live)}
        elif self.transition is not None:
            self.transition["pending"] = sorted(set(self.transition["pending"]) & live)
        if self.transition is not None and not self.transition["pending"]:
            self.transition = None

    def _record_ring(self, weights: dict[str, float]) -> None:
        """Remember the ring of the current generation: its owners' weights and parameters."""
        self.ring_history.append({"gen": self.ring_gen, "ring": RingParams(self.ring_unit).to_wire(),
                                  "owners": weights})

    def rings_after(self, gen: int) -> list[dict[str, Any]] | None:
        """The rings of generations ``gen + 1`` to the current one (``{"gen", "ring", "owners"}``),
        or None when this table no longer holds (or never held) all of them."""
        out = [r for r in self.ring_history if r["gen"] > gen]
        if self.ring_gen > gen and (not out or out[0]["gen"] != gen + 1):
            return None
        return out

    # -- views ------------------------------------------------------------------------------
    def address_holder(self, address: str, node: str) -> str | None:
        """Another node than ``node`` registered at ``address`` and not down (up, suspect or
        draining: it may still be serving there), or None. Two live nodes at one address send
        the clients of one to the other (gcache.meta.core refuses such a Register)."""
        return next((n for n, r in self.nodes.items()
                     if n != node and r["address"] == address and r["state"] != "down"), None)

    def down_for(self, now_ms: int) -> dict[str, float]:
        """Seconds since each down node was declared down, by the proposer's clock ``down_at``
        (0 when unknown: declared down by an older version)."""
        return {n: max(0.0, (now_ms - r["down_at"]) / 1000) if isinstance(r.get("down_at"), int) else 0.0
                for n, r in self.nodes.items() if r["state"] == "down"}

    def membership(self) -> dict[str, Any]:
        """What clients and daemons route by."""
        t = self.transition
        return {"epoch": self.epoch, "nodes": [dict(r) for r in self.nodes.values()],
                "ring": RingParams(self.ring_unit).to_wire(), "ring_gen": self.ring_gen,
                "transition": None if t is None else {
                    "epoch": t["epoch"], "from": [dict(r) for r in t["from"]], "ring": dict(t["ring"]),
                    "pending": list(t["pending"])}}

    def snapshot(self) -> bytes:
        return msgpack.packb({"v": COMMAND_VERSION, "epoch": self.epoch, "nodes": self.nodes,
                              "transition": self.transition, "ring_unit": self.ring_unit,
                              "ring_gen": self.ring_gen, "born": self.born})

    def restore(self, blob: bytes) -> None:
        data = msgpack.unpackb(blob)
        if data.get("v") != COMMAND_VERSION:
            raise CommandError(f"snapshot version {data.get('v')!r} not supported")
        self.epoch, self.nodes, self.transition = data["epoch"], data["nodes"], data["transition"]
        self.ring_unit = float(data["ring_unit"])
        self.ring_gen = int(data.get("ring_gen", 0))
        self.born = int(data.get("born", 0))
        self.ring_history.clear()
        self._record_ring({n: r["weight"] for n, r in self._owners().items()})  # older ones are not in it
