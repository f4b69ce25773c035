"""One request to each of several daemons (stats, clear, ping): all sent before any reply is
read, the replies read in the order they arrive.

Read one after another against one deadline, a stalled daemon first in line ran the deadline out
and every daemon after it was reported failed though it had answered (and a clear then said
"keeps its keys" of daemons that had deleted them)."""

from __future__ import annotations

import math
import select
import time
from collections.abc import Callable
from typing import Any

from gcache.client.pool import Pool
from gcache.errors import CallTimeout, GCacheError
from gcache.protocol import Op
from gcache.transport import Connection


def each_node(pool: Pool, targets: dict[str, str], op: Op, meta: dict[str, Any],
              pick: Callable[[dict[str, Any]], dict[str, Any]], timeout_s: float) -> dict[str, dict[str, Any]]:
    """``op`` with ``meta`` to each of ``targets`` (node id -> address): {node: pick(reply)}, or
    {node: {"error": why}}, in the order of ``targets``."""
    out: dict[str, dict[str, Any]] = {n: {} for n in targets}
    deadline = time.monotonic() + timeout_s
    waiting: dict[str, Connection] = {}
    for node, address in targets.items():
        conn = None
        try:
            conn = pool.get(node, address, deadline)
            conn.send(op, meta, [], deadline, timeout_s)
            waiting[node] = conn
        except GCacheError as exc:
            out[node] = {"error": str(exc)}
            if conn is not None:
                conn.close()
    while waiting:
        for node in answered(waiting, deadline):
            conn = waiting.pop(node)
            try:
                reply, _ = conn.recv_reply(deadline)
                out[node] = dict(pick(reply))
                pool.put(conn)
            except GCacheError as exc:
                out[node] = {"error": str(exc)}
                conn.close()
        if waiting and time.monotonic() >= deadline:
            for node, conn in waiting.items():
                out[node] = {"error": str(CallTimeout(node, timeout_s))}
                conn.close()
            break
    return out


def answered(waiting: dict[str, Connection], deadline: float) -> list[str]:
    """Nodes of ``waiting`` whose reply has started to arrive (or whose connection ended), by
    ``deadline``; a stream that cannot be polled counts as ready (read in turn)."""
    polled = {c.stream.fileno(): n for n, c in waiting.items() if c.stream.pollable}
    ready = [n for n, c in waiting.items() if not c.stream.pollable or c.buffered]
    if ready or not polled:
        return ready or list(waiting)
    poller = select.poll()
    for fd in polled:
        poller.register(fd, select.POLLIN)
    wait_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
    return [polled[fd] for fd, _ev in poller.poll(wait_ms)]
