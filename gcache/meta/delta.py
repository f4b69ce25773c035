"""Membership deltas: what a watcher that holds epoch P needs to build epoch C (pure functions).

A full membership lists every node (about 90 bytes each, plus the previous owners while a
handover is open): 45-75 KB for 500 daemons, sent to every watcher at every epoch. A delta
carries only the node records that changed, the ring parameters and the transition; the
transition's previous owners are left out when they are simply the owners at the epoch before
the transition opened, which the watcher holds. The handover's pending list is not part of it
(clients do not route by it; daemons learn it from their heartbeats).

``diff(prev, cur)`` and ``apply(prev, delta)`` satisfy
``apply(prev, diff(prev, cur)) == routing_view(cur)``.
"""

from __future__ import annotations

from typing import Any

OWNING = ("up", "suspect")
SAME = "same"


def owners_of(m: dict[str, Any]) -> list[dict[str, Any]]:
    """The records a transition's ``from`` lists: owners of ``m``, by id (as NodeTable does)."""
    return sorted(({"id": r["id"], "address": r["address"], "weight": r["weight"]}
                   for r in m["nodes"] if r["state"] in OWNING), key=lambda r: r["id"])


def routing_view(m: dict[str, Any]) -> dict[str, Any]:
    """``m`` without what is not for routing (the pending list)."""
    t = m.get("transition")
    return {**m, "transition": None if t is None else {**t, "pending": []}}


def diff(prev: dict[str, Any], cur: dict[str, Any]) -> dict[str, Any]:
    before = {r["id"]: r for r in prev["nodes"]}
    now = {r["id"]: r for r in cur["nodes"]}
    out: dict[str, Any] = {"epoch": cur["epoch"], "delta": prev["epoch"],
                           "nodes": [r for n, r in now.items() if before.get(n) != r],
                           "gone": [n for n in before if n not in now],
                           "order": list(now) if list(now) != [n for n in before if n in now] + [
                               n for n in now if n not in before] else None,
                           "ring": cur.get("ring"), "ring_gen": cur.get("ring_gen")}
    t, pt = cur.get("transition"), prev.get("transition")
    if t is None:
        out["transition"] = None
    elif pt is not None and pt["epoch"] == t["epoch"] and pt["from"] == t["from"] and pt.get("ring") == t.get("ring"):
        out["transition"] = SAME
    else:
        nt = {"epoch": t["epoch"], "ring": t.get("ring")}
        if t["from"] != owners_of(prev):
            nt["from"] = t["from"]
        out["transition"] = nt
    return out


def apply(prev: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """The membership ``d`` leads to from ``prev``; ValueError if ``d`` is not based on it."""
    if d.get("delta") != prev["epoch"]:
        raise ValueError(f"delta from epoch {d.get('delta')} does not apply to epoch {prev['epoch']}")
    nodes = {r["id"]: r for r in prev["nodes"]}
    for n in d["gone"]:
        nodes.pop(n, None)
    for r in d["nodes"]:
        nodes[r["id"]] = r
    if d.get("order"):
        nodes = {n: nodes[n] for n in d["order"]}
    t = d["transition"]
    if t == SAME:
        transition = prev.get("transition")
        transition = None if transition is None else {**transition, "pending": []}
    elif t is None:
        transition = None
    else:
        transition = {"epoch": t["epoch"], "from": t["from"] if "from" in t else owners_of(prev),
                      "ring": t.get("ring"), "pending": []}
    out = {"epoch": d["epoch"], "nodes": list(nodes.values()), "ring": d.get("ring"), "transition": transition}
    if d.get("ring_gen") is not None:
        out["ring_gen"] = d["ring_gen"]
    return out
