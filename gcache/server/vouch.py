"""Daemon-to-daemon questions over the data plane, all PINGs, peers asked in parallel, each on a
fresh connection, within one deadline.

* ``ask_peers``: ``{"probe": 1}`` asks whether the peer reaches a master leader (gcache.server.lease);
  it answers ``"lead"``: whether a heartbeat round it ran for the question (or had just run)
  reached the leader, and, as on every reply, ``"ep"``: the membership epoch it knows.
* ``announce_epoch``: ``{"ep": E}`` tells a peer that epoch E exists; a peer behind it refreshes
  its membership at once (instead of at its next heartbeat) and says which epoch it now routes
  by (``"rt"``: the newest whose ring it has built; it can know a newer one, ``"ep"``, whose
  ring is still being built, and until then it judges ownership by the older ring). A peer
  that cannot reach the master leader serves nothing until it routes by E and says so
  (``"cu"``: the epoch it must route by before it serves again).
"""

from __future__ import annotations

import logging
import random
import threading
import time

from gcache import protocol as P
from gcache.errors import GCacheError
from gcache.server.lease import PeerAnswer
from gcache.transport import open_connection

log = logging.getLogger("gcache.agent")
MAX_PEERS = 16  # asked per round; more owners than this: a random sample


def _ping_all(peers: dict[str, str], meta: dict, token: str | None, timeout_s: float) -> dict[str, dict | None]:
    """node id -> its PING reply's metadata, or None when it did not answer in time."""
    out: dict[str, dict | None] = dict.fromkeys(peers)
    deadline = time.monotonic() + timeout_s

    def ask(node: str, address: str) -> None:
        conn = None
        try:
            # the peers are the membership's node ids: an answer from another daemon at that address is none
            conn = open_connection(node, address, max(0.05, deadline - time.monotonic()), token, check_node=True)
            out[node] = conn.call(P.Op.PING, meta, deadline)
        except (GCacheError, OSError) as exc:
            if any(isinstance(e, ConnectionRefusedError) for e in (exc, exc.__cause__, exc.__context__)):
                out[node] = {"refused": True}  # nothing listens there: no process to serve anything
            log.debug("peer %s did not answer %s: %s", node, meta, exc)
        finally:
            if conn is not None:
                conn.close()

    threads = [threading.Thread(target=ask, args=item, name="gcache-vouch", daemon=True) for item in peers.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 0.05)
    return dict(out)  # a snapshot: a late answer does not count


def ask_peers(peers: dict[str, str], token: str | None, timeout_s: float) -> dict[str, PeerAnswer | None]:
    """node id -> its answer, or None when it did not answer in time (or could not say)."""
    if len(peers) > MAX_PEERS:
        peers = dict(random.sample(sorted(peers.items()), MAX_PEERS))
    return {n: None if r is None else PeerAnswer.from_reply(r)
            for n, r in _ping_all(peers, {"probe": 1}, token, timeout_s).items()}


def announce_epoch(peers: dict[str, str], epoch: int, token: str | None, timeout_s: float) -> dict[str, str]:
    """Tell ``peers`` that ``epoch`` exists; of those done with it, why: "routes" (it routes by
    it), "holds" (it serves nothing until it does) or "refused" (nothing listens there)."""
    out = {}
    for n, r in _ping_all(peers, {"ep": epoch}, token, timeout_s).items():
        if r is None:
            continue
        if r.get("refused") is True:
            out[n] = "refused"
        elif isinstance(r.get("rt"), int) and r["rt"] >= epoch:
            out[n] = "routes"
        elif isinstance(r.get("cu"), int) and r["cu"] >= epoch:
            out[n] = "holds"
    return out


class PeerAsk:
    """``ask_peers`` in a thread, started before it is needed: a daemon that had to ask its
    peers last round asks them again while its own master round is still waiting, so in a master
    outage a lease renewal costs one round trip, not two."""

    def __init__(self, peers: dict[str, str], token: str | None, timeout_s: float) -> None:
        self.started_at = time.monotonic()
        self.peers = peers
        self._answers: dict[str, PeerAnswer | None] = dict.fromkeys(peers)
        self._thread = threading.Thread(target=self._run, args=(token, timeout_s), name="gcache-vouch", daemon=True)
        self._thread.start()

    def _run(self, token: str | None, timeout_s: float) -> None:
        self._answers = ask_peers(self.peers, token, timeout_s)

    def answers(self) -> dict[str, PeerAnswer | None]:
        self._thread.join()
        return self._answers

