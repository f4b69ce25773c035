"""The client's side of the local shared-memory path's lease protocol (the daemon's side and
the rules are in gcache.server.local).

A request's reply is turned into a ``Pending``: its copies and what finishes it. The fan-out
runs every copy of the batch at once, after the last owner has answered (so the copy threads
do not compete with daemons still working on their requests), then each request's finish.

* Gets: LGET pinned the hits under a lease and answered their arena offsets; copy them out of
  the mapped arena, then release the lease with LDONE. A copy finished well inside the lease
  cannot have raced a reuse of its slots, so the release is one-way; otherwise LDONE says
  whether the lease still held, and keys whose lease expired during the copy become misses
  (their bytes may be torn).
* Puts: LALLOC reserved slots under a lease; copy the values in, then LCOMMIT makes them visible.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.client.replies import BUFFER_TOO_SMALL, OK, Dest, nbytes, recv_parts, statuses
from gcache.errors import ProtocolError
from gcache.protocol import Op, Status
from gcache.transport import Connection

if TYPE_CHECKING:
    from gcache.client.ops import GetOp, PutOp
    from gcache.client.pool import Pool

LEASE_MARGIN_S = 0.05  # a local read finished this long before its lease deadline is valid
PARALLEL_COPY_BYTES = 4 << 20  # a batch's copies this large are split over two threads
Copies = list[tuple[memoryview, memoryview]]  # (dest, src) pairs
CPUS = os.cpu_count() or 1


class Pending:
    """A local-path request whose copies wait for the batch's other replies (all of a batch's
    copies then run at once, over two threads when large) and what finishes it afterwards."""

    __slots__ = ("finish", "pairs")

    def __init__(self, pairs: Copies, finish: Callable[[float], None]) -> None:
        self.pairs, self.finish = pairs, finish


def copy_out(op: GetOp, idxs: list[int], reply: dict[str, Any], conn: Connection, deadline: float) -> Pending:
    """Start finishing an LGET: what to copy out of the arena into each hit's destination, and
    the lease's release (after the copy)."""
    arena = conn.arena
    assert arena is not None
    sts = statuses(reply, len(idxs), conn.node)
    szs, offs = reply.get("sz"), reply.get("off")
    if not isinstance(szs, list) or not isinstance(offs, list) or len(szs) != len(idxs) != len(offs):
        conn.broken = True
        raise ProtocolError(f"{conn.node}: LGET reply without one size and offset per key")
    status, sizes = op.status, op.sizes_out
    copied = []
    pairs: Copies = []  # out of the arena
    for i, st, sz, off in zip(idxs, sts, szs, offs):
        if st is not OK:
            status[i] = st
            continue
        dest = op.dest(i, sz)
        if nbytes(dest) < sz:
            if off < 0:
                conn.discard(sz, deadline)
            status[i], sizes[i] = BUFFER_TOO_SMALL, sz
            continue
        if off < 0:  # sent inline (not in the arena)
            recv_parts(conn, dest, sz, deadline)
        else:
            pairs += copy_pairs(arena[off:off + sz], dest)
            copied.append(i)
        status[i], sizes[i] = OK, sz
    op.take_meta(idxs, reply)
    lease, dl = reply.get("ls"), reply.get("dl")

    def release(deadline: float) -> None:
        if not lease:
            return
        if isinstance(dl, float) and time.monotonic() < dl - LEASE_MARGIN_S:
            conn.send_oneway(Op.LDONE, {"ls": [lease]}, deadline)
            return
        if conn.call(Op.LDONE, {"ls": [lease]}, deadline).get("ok") != [True]:
            for i in copied:  # the lease expired during the copy: the bytes may be torn
                status[i], sizes[i] = Status.NOT_FOUND, 0

    return Pending(pairs, release)


def commit_put(op: PutOp, idxs: list[int], reply: dict[str, Any], conn: Connection, pool: Pool,
               deadline: float) -> Pending:
    """Start finishing an LALLOC: what to copy into the reserved slots, then LCOMMIT them."""
    arena = pool.writable_arena(conn, deadline)
    reserved = statuses(reply, len(idxs), conn.node)
    pairs: Copies = []
    for i, st, off in zip(idxs, reserved, reply.get("off") or []):
        if st is Status.OK:
            for part in op.views[i]:
                pairs.append((arena[off:off + len(part)], part))
                off += len(part)

    def commit(deadline: float) -> None:
        done = statuses(conn.call(Op.LCOMMIT, {"ls": reply["ls"]}, deadline), len(idxs), conn.node)
        for i, st0, st in zip(idxs, reserved, done):
            op.status[i] = st if st0 is Status.OK else st0

    return Pending(pairs, commit)


def copy_all(pairs: Copies) -> None:
    """Do every (dest, src) copy; a batch of at least PARALLEL_COPY_BYTES is split in two
    halves by bytes, one copied by a helper thread while this one copies the other (numpy copies
    without the GIL, and one core does not saturate the memory bus)."""
    total = sum(len(d) for d, _s in pairs)
    if total < PARALLEL_COPY_BYTES or CPUS < 2:
        _copy_each(pairs)
        return
    first, second = halves(pairs, total // 2)
    done = _helper().submit(_copy_each, second)
    try:
        _copy_each(first)
    finally:
        done.result()


def halves(pairs: Copies, cut: int) -> tuple[Copies, Copies]:
    """``pairs`` as two lists of copies, the first moving exactly ``cut`` bytes (a copy that
    straddles the cut is split in two)."""
    first: Copies = []
    acc = 0
    for j, (d, src) in enumerate(pairs):
        if acc + len(d) <= cut:
            first.append((d, src))
            acc += len(d)
            continue
        k = cut - acc
        if k:
            first.append((d[:k], src[:k]))
        return first, [(d[k:], src[k:]), *pairs[j + 1:]]
    return first, []


def _copy_each(pairs: Copies) -> None:
    for d, src in pairs:
        memcpy(d, src)


_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    """The copy helper thread of this process (a new one after a fork: threads do not survive it)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="gcache-copy"))
        return _pool[1]


def memcpy(dest: memoryview, src: memoryview) -> None:
    """One copy; numpy releases the GIL for it, so local copies can run in parallel."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def copy_pairs(src: memoryview, dest: Dest) -> list[tuple[memoryview, memoryview]]:
    """The (dest, src) copies that put ``src`` into one view or, in order, into several."""
    if not isinstance(dest, list):
        return [(dest[: len(src)], src)]
    out, pos = [], 0
    for part in dest:
        if pos >= len(src):
            break
        n = min(len(part), len(src) - pos)
        if n:  # an empty part takes nothing; the parts after it take the rest
            out.append((part[:n], src[pos:pos + n]))
            pos += n
    return out
