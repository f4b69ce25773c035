"""Asking peers over the data plane whether they reach a master leader (gcache.server.lease).

The question is a PING carrying ``{"probe": 1}``; a daemon with masters answers ``"lead"``: whether
a heartbeat round it ran for the question (or one it had just run) reached the Raft leader, and,
as on every reply, ``"ep"``: the membership epoch it knows. Peers are asked in parallel, each on
a fresh connection, within one deadline.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from gcache import protocol as P
from gcache.client.connection import Connection
from gcache.errors import GCacheError
from gcache.server.lease import PeerAnswer

log = logging.getLogger("gcache.agent")
MAX_PEERS = 16  # asked per round; more owners than this: a random sample


def ask_peers(peers: dict[str, str], token: str | None, timeout_s: float) -> dict[str, PeerAnswer | None]:
    """node id -> its answer, or None when it did not answer in time (or could not say)."""
    if len(peers) > MAX_PEERS:
        peers = dict(random.sample(sorted(peers.items()), MAX_PEERS))
    out: dict[str, PeerAnswer | None] = dict.fromkeys(peers)
    deadline = time.monotonic() + timeout_s

    def ask(node: str, address: str) -> None:
        conn = None
        try:
            conn = Connection(node, address, max(0.05, deadline - time.monotonic()), token)
            out[node] = PeerAnswer.from_reply(conn.call(P.Op.PING, {"probe": 1}, deadline))
        except (GCacheError, OSError) as exc:
            log.debug("peer %s did not answer the lease probe: %s", node, exc)
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=ask, args=item, name="gcache-vouch", daemon=True) for item in peers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 0.05)
    return dict(out)  # a snapshot: a late answer does not count
