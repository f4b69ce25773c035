"""The client's side of the local shared-memory path's lease protocol (the daemon's side and
the rules are in gcache.server.local).

* Gets: LGET pinned the hits under a lease and answered their arena offsets; copy them out of
  the mapped arena, then release the lease with LDONE. A copy finished well inside the lease
  cannot have raced a reuse of its slots, so the release is one-way; otherwise LDONE says
  whether the lease still held, and keys whose lease expired during the copy become misses
  (their bytes may be torn).
* Puts: LALLOC reserved slots under a lease; copy the values in, then LCOMMIT makes them visible.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from gcache.client.replies import Dest, nbytes, recv_parts, statuses
from gcache.errors import ProtocolError
from gcache.protocol import Op, Status
from gcache.transport import Connection

if TYPE_CHECKING:
    from gcache.client.ops import GetOp, PutOp
    from gcache.client.pool import Pool

LEASE_MARGIN_S = 0.05  # a local read finished this long before its lease deadline is valid


def copy_out(op: GetOp, idxs: list[int], reply: dict[str, Any], conn: Connection, deadline: float) -> None:
    """Finish an LGET: copy each hit out of the arena into its destination, release the lease."""
    arena = conn.arena
    assert arena is not None
    sts = statuses(reply, len(idxs), conn.node)
    szs, offs = reply.get("sz"), reply.get("off")
    if not isinstance(szs, list) or not isinstance(offs, list) or len(szs) != len(idxs) != len(offs):
        conn.broken = True
        raise ProtocolError(f"{conn.node}: LGET reply without one size and offset per key")
    status, sizes = op.status, op.sizes_out
    copied = []
    for i, st, sz, off in zip(idxs, sts, szs, offs):
        if st is not Status.OK:
            status[i] = st
            continue
        dest = op.dest(i, sz)
        if nbytes(dest) < sz:
            if off < 0:
                conn.discard(sz, deadline)
            status[i], sizes[i] = Status.BUFFER_TOO_SMALL, sz
            continue
        if off < 0:  # sent inline (not in the arena)
            recv_parts(conn, dest, sz, deadline)
        else:
            for d, src in copy_pairs(arena[off:off + sz], dest):
                memcpy(d, src)
            copied.append(i)
        status[i], sizes[i] = Status.OK, sz
    op.take_meta(idxs, reply)
    if reply.get("ls"):
        dl = reply.get("dl")
        if isinstance(dl, float) and time.monotonic() < dl - LEASE_MARGIN_S:
            conn.send_oneway(Op.LDONE, {"ls": [reply["ls"]]}, deadline)
            return
        held = conn.call(Op.LDONE, {"ls": [reply["ls"]]}, deadline).get("ok")
        if held != [True]:
            for i in copied:  # the lease expired during the copy: the bytes may be torn
                status[i], sizes[i] = Status.NOT_FOUND, 0


def commit_put(op: PutOp, idxs: list[int], reply: dict[str, Any], conn: Connection, pool: Pool,
               deadline: float) -> None:
    """Finish an LALLOC: copy the values into their reserved slots, then LCOMMIT them."""
    arena = pool.writable_arena(conn, deadline)
    reserved = statuses(reply, len(idxs), conn.node)
    for i, st, off in zip(idxs, reserved, reply.get("off") or []):
        if st is Status.OK:
            for part in op.views[i]:
                memcpy(arena[off:off + len(part)], part)
                off += len(part)
    done = statuses(conn.call(Op.LCOMMIT, {"ls": reply["ls"]}, deadline), len(idxs), conn.node)
    for i, st0, st in zip(idxs, reserved, done):
        op.status[i] = st if st0 is Status.OK else st0


def memcpy(dest: memoryview, src: memoryview) -> None:
    """One copy; numpy releases the GIL for it, so local copies can run in parallel."""
    np.copyto(np.frombuffer(dest, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def copy_pairs(src: memoryview, dest: Dest) -> list[tuple[memoryview, memoryview]]:
    """The (dest, src) copies that put ``src`` into one view or, in order, into several."""
    if not isinstance(dest, list):
        return [(dest[: len(src)], src)]
    out, pos = [], 0
    for part in dest:
        n = min(len(part), len(src) - pos)
        if n <= 0:
            break
        out.append((part[:n], src[pos:pos + n]))
        pos += n
    return out
