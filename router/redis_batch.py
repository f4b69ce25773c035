"""The Redis state's request batches (``router.state_redis``): the commands one event-loop
turn's calls become, and what each call gets back. No I/O.

A batch is a list of (mode, arguments, future). Every snapshot of the batch shares one
``SYNC`` run (mode 1), which carries the replica's buffered changes; each strict acquire is
one more run (mode 3); a batch of flushes only is one run of mode 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

from router.resp import Arg
from router.state_base import WorkerState
from router.state_memory import MemoryState

Batch = list[tuple[int, Sequence[Arg], asyncio.Future]]

FLUSH, SNAPSHOT, SNAPSHOT_TICKET, STRICT_ACQUIRE = 0, 1, 2, 3  # RedisState._call's modes; SYNC's: 0, 1, 3
MISSED_MAX = 10_000  # prefix records of requests admitted while Redis was unreachable, kept for the resync
REPLAY_ARGS = 50_000  # op arguments per SYNC call that replays them


class Common:
    """The part of a snapshot every request of one batch shares: per worker its spec, the other
    replicas' load, health and circuit state (decoded once per batch)."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[tuple[str, int, int, int, bool, bool]]) -> None:
        self.rows = rows


def commands(batch: Batch, ops: list[Arg], head: list[Arg], failures: int, open_s: float) -> list[list[Arg]]:
    """The batch as script calls (``head``: EVALSHA, sha, 0 and the fixed arguments): one for
    every snapshot, carrying the buffered changes ``ops``, then one per strict acquire."""
    snaps = [(mode, hashes) for mode, hashes, _ in batch if mode in (SNAPSHOT, SNAPSHOT_TICKET)]
    strict = [hashes for mode, hashes, _ in batch if mode == STRICT_ACQUIRE]
    cmds: list[list[Arg]] = []
    if snaps or not strict:
        cmd = [*head, 1 if snaps else 0, failures, open_s, len(ops), *ops]
        if snaps:
            cmd.append(len(snaps))
            for mode, hashes in snaps:
                cmd += [1 if mode == SNAPSHOT_TICKET else 0, len(hashes), *hashes]
        cmds.append(cmd)
    for i, hashes in enumerate(strict):
        o: list[Arg] = ops if i == 0 and not cmds else []
        cmds.append([*head, 3, failures, open_s, len(o), *o, *hashes])
    return cmds


def deliver(batch: Batch, results: list, common_of: Callable[[list], Common]) -> None:
    """Hand each call its result: a snapshot (Common, (ticket, matches)), a strict acquire its
    0/1, a flush []. ``common_of`` decodes the shared part (the SYNC result: rows, per-request
    matches, other replicas' queue heads) once for the batch."""
    k = 0
    snap_res: list | None = None
    common: Common | None = None
    if any(mode in (SNAPSHOT, SNAPSHOT_TICKET) for mode, _, _ in batch):
        snap_res = results[0]
        common = common_of(snap_res)
        k = 1
    elif not any(mode == STRICT_ACQUIRE for mode, _, _ in batch):
        k = 1
    q = 0
    for mode, _, fut in batch:
        if fut.done():
            continue
        if mode == STRICT_ACQUIRE:
            fut.set_result(results[k])
            k += 1
        elif mode == FLUSH:
            fut.set_result([])
        else:
            assert snap_res is not None
            fut.set_result((common, snap_res[1][q]))
            q += 1


def merge(common: Common, matches: list, hashes: Sequence[int], local: MemoryState) -> list[WorkerState]:
    """Redis's view of the other replicas plus this replica's exact local counts."""
    now = local.clock()
    out = []
    for name, i, reqs, work, down, is_open in common.rows:
        spec = local.workers.get(name)
        if spec is None:
            continue  # removed locally since the batch was sent
        own_r, own_w = local.loads.get(name)
        m = int(matches[2 * i])
        age_s = float(matches[2 * i + 1])
        if hashes:
            lm, lage = local.index.match_age(name, hashes, now)
            m = max(m, lm)
            age_s = min(age_s if age_s >= 0 else float("inf"), lage)
        else:
            age_s = age_s if age_s >= 0 else float("inf")
        out.append(WorkerState(spec, not down, m, reqs + own_r, work + own_w, age_s, is_open))
    return out


def replay_ops(missed: Iterable[tuple[str, Sequence[Arg]]], per_call: int = REPLAY_ARGS) -> list[list[Arg]]:
    """Prefix records made while Redis was unreachable as ``R`` ops, cut into the op lists of
    SYNC calls of about ``per_call`` arguments each (all sent in one pipeline by the resync)."""
    out: list[list[Arg]] = []
    ops: list[Arg] = []
    for w, hashes in missed:
        ops += ["R", w, len(hashes), *hashes]
        if len(ops) >= per_call:
            out.append(ops)
            ops = []
    if ops:
        out.append(ops)
    return out
