"""The master's node table as golden sequences: commands in, epochs / states / transitions out.

Each block of ``tests/data/nodetable.golden`` is a command, ``----``, then what the table answers
and looks like afterwards. Blocks separated by a line ``=== name`` start from an empty table.
Rewrite the expectations after an intended change with ``GCACHE_REWRITE_GOLDEN=1`` and review
the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gcache.meta.nodetable import CommandError, GiB, NodeTable
from gcache.sizes import parse_size

GOLDEN = Path(__file__).parent / "data" / "nodetable.golden"


def run(table: NodeTable, line: str) -> str:
    op, *args = line.split()
    cmd: dict = {"v": 1, "op": op}
    if op == "register":
        cmd.update(node=args[0], address=f"10.0.0.{ord(args[0][0]) % 250}:7400", capacity=parse_size(args[1]))
    elif op == "set_state":
        cmd.update(node=args[0], inc=int(args[1]), state=args[2])
    elif op == "handover_done":
        cmd.update(node=args[0], epoch=int(args[1]))
    elif op == "handover_done_many":
        cmd.update(reports=[{"node": a.split(":")[0], "epoch": int(a.split(":")[1])} for a in args])
    elif op in ("drain", "remove"):
        cmd.update(node=args[0])
    elif op == "restart-from-snapshot":
        blob = table.snapshot()
        table.__init__()
        table.restore(blob)
        return "restored"
    elif op == "raw":
        cmd = json.loads(" ".join(args))  # a malformed command, written out in the golden file
    try:
        out = table.apply(cmd)
    except CommandError as exc:
        return f"refused: {exc}"
    return " ".join(f"{k}={out[k]}" for k in sorted(out)).replace("'", "")


def render(table: NodeTable) -> str:
    m = table.membership()
    nodes = " ".join(f"{r['id']}={r['state']}/{r['inc']}/w{r['weight']:g}" for r in m["nodes"]) or "-"
    lines = [f"epoch {m['epoch']} ring-unit {m['ring']['unit']:g} ring-gen {m['ring_gen']}", f"nodes {nodes}"]
    t = m["transition"]
    if t is None:
        lines.append("transition none")
    else:
        lines.append(f"transition epoch {t['epoch']} from [{','.join(r['id'] for r in t['from'])}] "
                     f"ring-unit {t['ring']['unit']:g} pending [{','.join(t['pending'])}]")
    return "\n".join(lines)


def replay(text: str) -> str:
    out: list[str] = []
    table = NodeTable()
    for block in text.strip().split("\n\n"):
        lines = block.strip().splitlines()
        head = [ln for ln in lines if ln.startswith(("#", "==="))]
        if any(ln.startswith("===") for ln in head):
            table = NodeTable()
        cmd = next(ln for ln in lines if not (ln.startswith(("#", "==="))))
        out.append("\n".join([*head, cmd, "----", run(table, cmd), render(table)]))
    return "\n\n".join(out) + "\n"


def test_golden_sequences():
    text = GOLDEN.read_text()
    got = replay(text)
    if os.environ.get("GCACHE_REWRITE_GOLDEN"):
        GOLDEN.write_text(got)
    assert got == text


def test_weight_is_capacity_in_gib():
    t = NodeTable()
    t.apply({"v": 1, "op": "register", "node": "a", "address": "10.0.0.1:1", "capacity": 64 * GiB})
    assert t.nodes["a"]["weight"] == 64.0


def test_the_table_keeps_the_last_rings_by_generation():
    t = NodeTable()
    for n in ("a", "b", "c"):
        t.apply({"v": 1, "op": "register", "node": n, "address": f"10.0.0.{ord(n)}:1", "capacity": GiB})
    t.apply({"v": 1, "op": "set_state", "node": "c", "inc": 1, "state": "down"})
    t.apply({"v": 1, "op": "register", "node": "c", "address": "10.0.0.99:1", "capacity": GiB})
    assert t.ring_gen == 5
    rings = t.rings_after(3)
    assert [r["gen"] for r in rings] == [4, 5]
    assert sorted(rings[0]["owners"]) == ["a", "b"] and sorted(rings[1]["owners"]) == ["a", "b", "c"]
    assert rings[0]["ring"] == t.membership()["ring"]
    assert t.rings_after(5) == [] and len(t.rings_after(0)) == 5
    blob = t.snapshot()
    t2 = NodeTable()
    t2.restore(blob)
    assert t2.rings_after(4) == rings[1:] and t2.rings_after(3) is None  # older ones are not in snapshots


def test_a_new_table_numbers_its_epochs_from_the_first_registrations_base():
    """Masters keep no state on disk: a group started afresh numbers its epochs and rings from
    the base its first registration carries (the proposer's clock), above the old group's; later
    registrations' bases change nothing."""
    t = NodeTable()
    out = t.apply({"v": 1, "op": "register", "node": "a", "address": "10.0.0.1:1", "capacity": GiB, "base": 5000})
    assert out["epoch"] == t.epoch == 5001 and t.ring_gen == 5001 and t.rings_after(5000)[0]["gen"] == 5001
    t.apply({"v": 1, "op": "register", "node": "b", "address": "10.0.0.2:1", "capacity": GiB, "base": 9000})
    assert t.epoch == 5002 and t.ring_gen == 5002
    assert t.born == 5000  # the table's first epoch, kept through snapshots (agent._removed)
    u = NodeTable()
    u.restore(t.snapshot())
    assert u.born == 5000
    for bad in (0, -1, "7", None):
        u = NodeTable()
        u.apply({"v": 1, "op": "register", "node": "a", "address": "10.0.0.1:1", "capacity": GiB, "base": bad})
        assert u.epoch == 1 and u.ring_gen == 1


def test_a_node_declared_down_keeps_when_in_the_table():
    """A down node's record carries when the leader declared it down (its wall clock, in the
    replicated table): whichever master answers a registration says how long ago, not what it
    happened to hear itself (a follower cut off from the node, or a new leader, said longer)."""
    t = NodeTable()
    for n in "ab":
        t.apply({"v": 1, "op": "register", "node": n, "address": f"10.0.0.{ord(n)}:1", "capacity": GiB})
    t.apply({"v": 1, "op": "set_state", "node": "a", "inc": 1, "state": "suspect", "at": 1000})
    assert "down_at" not in t.nodes["a"]
    t.apply({"v": 1, "op": "set_state", "node": "a", "inc": 1, "state": "down", "at": 2000})
    assert t.nodes["a"]["down_at"] == 2000 and t.down_for(5000) == {"a": 3.0}
    u = NodeTable()
    u.restore(t.snapshot())
    assert u.nodes["a"]["down_at"] == 2000  # a master that joins from a snapshot knows it too
    t.apply({"v": 1, "op": "register", "node": "a", "address": "10.0.0.97:1", "capacity": GiB})
    assert "down_at" not in t.nodes["a"] and t.nodes["a"]["state"] == "up"
