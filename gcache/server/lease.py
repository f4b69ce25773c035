"""A daemon's membership lease: when it may serve, decided from what the masters and its peers
say (pure: no I/O, no clock; gcache.server.agent feeds it).

Only the Raft leader's failure detector declares a node DOWN, and it does so ``--down-after``
seconds after the last heartbeat *it* received. So the lease is the leader's acknowledgement:

* A heartbeat round the leader acknowledged renews the lease from the moment the round was
  sent; without a renewal the daemon fences itself (refuses every data request) once
  ``--fence-after`` has passed. With ``--fence-after`` + the leader's step-down time (a leader
  that hears no majority steps down after gcache.meta.raft.LEADER_FALLBACK_S) below
  ``--down-after``, a daemon has stopped serving before any leader can declare it DOWN.
* A master that says this incarnation was declared down is believed at once (a DOWN is
  committed; it cannot be undone): the daemon fences. It registers again (a new incarnation,
  dropping everything it held: see ``Agent._register``) only through a round the leader
  answered, so a daemon that reaches followers but not the leader stays out instead of joining
  and being declared down again in a loop.
* No leader answered: either the masters are out (no leader anywhere, or none reachable by
  anyone), and serving under the last membership is safe because nobody can change it; or this
  daemon is cut off and the others carry on without it. The daemon asks its peers (the other
  owners of its last membership, over the data plane) to try the masters *now*. Only if every
  one of them answers, none reached a leader, and none knows a newer epoch, is it an outage:
  the lease is renewed. Any peer silent, any peer that reached a leader or knows a newer epoch:
  no renewal, so the daemon fences when the lease runs out. A daemon with no peers cannot tell
  the two apart and fences.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class Verdict(enum.Enum):
    RENEW = "renew"  # the leader acknowledged this incarnation
    REJOIN = "rejoin"  # the leader says this incarnation is down or unknown: register anew
    WAIT_FOR_LEADER = "wait_for_leader"  # declared down, leader out of reach: stay fenced
    ASK_PEERS = "ask_peers"  # no leader answered: a master outage, or this daemon is cut off


class Mode(enum.Enum):
    """What the daemon is doing, for logs and status."""

    SERVING = "serving"  # lease renewed by the leader
    OUTAGE = "outage"  # no leader reachable by anyone: serving under the last membership
    CUT_OFF = "cut_off"  # no leader reachable by this daemon, but not a confirmed outage
    DOWN = "down"  # declared down: fenced until it registers again
    REGISTERING = "registering"


@dataclass(frozen=True)
class PeerAnswer:
    """A peer's answer to "can you reach a master leader now?" and the epoch it knows."""

    leader: bool
    epoch: int

    @classmethod
    def from_reply(cls, meta: dict[str, Any]) -> PeerAnswer | None:
        lead, ep = meta.get("lead"), meta.get("ep")
        if not isinstance(lead, bool) or not isinstance(ep, int):
            return None  # a peer that cannot say (no masters configured, an old version)
        return cls(lead, ep)


def judge(replies: Sequence[dict[str, Any]]) -> tuple[Verdict, dict[str, Any] | None]:
    """What a heartbeat round means, from the replies of the masters that answered; also the
    leader's reply when one answered (with two leaders briefly, the newer one: higher epoch)."""
    leaders = [r for r in replies if r.get("leader")]
    if leaders:
        lead = max(leaders, key=lambda r: int(r.get("epoch", 0)))
        return (Verdict.RENEW if lead.get("ok") else Verdict.REJOIN), lead
    if any(r.get("reason") == "declared down" for r in replies):
        return Verdict.WAIT_FOR_LEADER, None
    return Verdict.ASK_PEERS, None


def outage_confirmed(epoch: int, answers: Sequence[PeerAnswer | None]) -> bool:
    """Whether the peers' answers show a master outage (nobody reaches a leader) rather than
    this daemon being cut off: every peer answered, none reached a leader, none is ahead."""
    return bool(answers) and all(a is not None and not a.leader and a.epoch <= epoch for a in answers)
