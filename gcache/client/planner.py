"""The fan-out planner: which keys go to which daemon in which request. Pure functions (no I/O,
no clock), tested alone; gcache.client.fanout runs the plans.

A batch is split by owner (the consistent-hash ring); one owner's keys go out as several
requests when they are many (``split_keys``) or large (``split_bytes``, when the value sizes are
known), so one caller keeps the owner's threads and the wire busy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gcache.client.replies import NOT_FOUND, NOT_OWNER
from gcache.protocol import MAX_BATCH_KEYS, MAX_KEY_BYTES, MAX_META_BYTES, Status


@dataclass(frozen=True)
class Request:
    """One request of a round: the keys (positions in the batch) that ``node`` gets."""

    node: str
    idxs: list[int]


def by_owner(which: Sequence[int], owners: Sequence[str]) -> dict[str, list[int]]:
    """Group batch positions ``which`` by their owner (``owners[j]`` owns ``which[j]``), in order."""
    out: dict[str, list[int]] = {}
    for i, owner in zip(which, owners):
        out.setdefault(owner, []).append(i)
    return out


#: keys in one request whose values' sizes are known (a put): its metadata (keys of up to
#: MAX_KEY_BYTES each, and their sizes) stays well under MAX_META_BYTES and the key count under
#: MAX_BATCH_KEYS. A put of 65,537 tiny values, or of 17,000 keys of 1,000 bytes, went out as one
#: request the daemon refused whole (a prober).
SIZED_SPLIT_KEYS = 4096
assert SIZED_SPLIT_KEYS * (MAX_KEY_BYTES + 64) < MAX_META_BYTES // 2 and SIZED_SPLIT_KEYS <= MAX_BATCH_KEYS


def split(idxs: list[int], sizes: Sequence[int] | None, split_bytes: int, split_keys: int) -> list[list[int]]:
    """Cut one owner's keys into requests of at most ``split_bytes`` (when the value sizes are
    known; a single larger value is a request of its own) and SIZED_SPLIT_KEYS keys, or of
    ``split_keys`` keys."""
    if sizes is None:
        return [idxs[i:i + split_keys] for i in range(0, len(idxs), split_keys)]
    out: list[list[int]] = [[]]
    total = 0
    for i in idxs:
        if out[-1] and (total + sizes[i] > split_bytes or len(out[-1]) >= SIZED_SPLIT_KEYS):
            out.append([])
            total = 0
        out[-1].append(i)
        total += sizes[i]
    return out


def plan(which: Sequence[int], owners: Sequence[str], sizes: Sequence[int] | None, split_bytes: int,
         split_keys: int, by_keys_only: Callable[[str], bool] | None = None) -> list[Request]:
    """The requests of one round over positions ``which`` owned by ``owners``. Owners for which
    ``by_keys_only(node)`` holds are split by key count alone (the local path: its requests
    carry offsets, not bytes, and the client does the copying)."""
    return [Request(node, chunk) for node, idxs in by_owner(which, owners).items()
            for chunk in split(idxs, None if by_keys_only is not None and by_keys_only(node) else sizes,
                               split_bytes, split_keys)]


def to_retry(status: Sequence[Status]) -> list[int]:
    """Keys a daemon refused as NOT_OWNER: our membership was stale; retried once on a newer one."""
    if NOT_OWNER not in status:  # the usual case, without a Python step per key
        return []
    return [i for i, st in enumerate(status) if st is NOT_OWNER]


def misses(status: Sequence[Status], final: set[int]) -> list[int]:
    """Keys that missed, and whose miss is not final (``final``: a client wrote or deleted the
    key on its new owner during a handover, gcache.server.touchlog)."""
    if NOT_FOUND not in status:
        return []
    return [i for i, st in enumerate(status) if st is NOT_FOUND and i not in final]


def to_fall_back(which: Sequence[int], now: Sequence[str], before: Sequence[str],
                 reachable: set[str] | dict[str, str]) -> list[int]:
    """Of the misses ``which`` (owned by ``now[j]`` and, in the previous membership, by
    ``before[j]``), those to look up on their previous owner during a handover: the owner
    changed and the previous one is still in reach."""
    return [i for i, a, b in zip(which, now, before) if a != b and b in reachable]
