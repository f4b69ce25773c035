"""Raft replication of a state machine, with pysyncobj kept behind this one small interface.

The rest of gcache sees ``propose(command) -> result``, ``is_leader`` and ``leader``; commands
and snapshots are versioned msgpack (the state machine's own format). pysyncobj's wire format is
zlib(pickle), so the group always runs with a password (the cluster token: it encrypts and
authenticates every Raft message) and an explicit bind address (never a wildcard), and reads
from a peer that has not authenticated yet are bounded (gcache.meta.raft_guard).

Timeouts: 150-300 ms elections, 30 ms append period, 10 ms ticks and a 0.5 s reconnect, which
gives sub-second leader failover; appendEntries batching is off for ~1 ms commits.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import msgpack
from pysyncobj import SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.syncobj import SyncObjException

from gcache.meta import raft_guard
from gcache.net.address import host_of, is_wildcard

log = logging.getLogger(__name__)
RAFT_LEADER = 2  # pysyncobj's _RAFT_STATE.LEADER, as passed to onStateChanged
STATES = ("follower", "candidate", "leader")


# A leader that has heard from no majority for this long steps down (pysyncobj's default is 30 s).
# Daemons renew their membership lease only from the leader's acknowledgement, so this bounds how
# long a leader cut off in a minority can still grant leases: keep --fence-after + this below the
# masters' --down-after (defaults: 2 s + 0.6 s < 3 s).
LEADER_FALLBACK_S = 0.6


def raft_address_error(self_addr: str) -> str | None:
    """Why a master cannot bind Raft at ``self_addr`` (None: it can): the peers know a master by
    the address it binds, so it must be that address, not every interface's."""
    if is_wildcard(host_of(self_addr)):
        return f"Raft address {self_addr!r}: bind an explicit address, not a wildcard"
    return None


class StateMachine(Protocol):
    def apply(self, cmd: dict[str, Any]) -> dict[str, Any]: ...
    def snapshot(self) -> bytes: ...
    def restore(self, blob: bytes) -> None: ...


class ProposalFailed(Exception):
    """The command was not committed before the deadline (no leader, election in progress)."""


class _Log(SyncObjConsumer):  # type: ignore[misc]  # pysyncobj is untyped
    def __init__(self, sm: StateMachine) -> None:
        self._sm = sm  # set before the base __init__ so it is not part of pysyncobj's snapshot
        super().__init__()

    @replicated  # type: ignore[untyped-decorator]
    def apply(self, blob: bytes) -> bytes:
        try:
            return msgpack.packb({"ok": self._sm.apply(msgpack.unpackb(blob))})
        except (ValueError, KeyError, TypeError) as exc:  # a refused command changes nothing
            return msgpack.packb({"error": str(exc)})

    def _serialize(self) -> dict[str, bytes]:
        return {"snapshot": self._sm.snapshot()}

    def _deserialize(self, data: dict[str, bytes]) -> None:
        self._sm.restore(data["snapshot"])


class RaftGroup:
    def __init__(self, self_addr: str, peers: list[str], password: str, sm: StateMachine,
                 election_timeout_s: tuple[float, float] = (0.15, 0.3), leader_fallback_s: float = LEADER_FALLBACK_S) -> None:
        if not password:
            raise ValueError("a Raft group needs a password (the cluster token): pysyncobj unpickles its peers' messages")
        if err := raft_address_error(self_addr):
            raise ValueError(err)
        raft_guard.install()
        conf = SyncObjConf(
            password=password,
            bindAddress=self_addr,
            appendEntriesUseBatch=False,
            raftMinTimeout=election_timeout_s[0],
            raftMaxTimeout=election_timeout_s[1],
            appendEntriesPeriod=0.03,
            # pysyncobj checks its election deadline once per tick (50 ms by default): with two
            # followers that makes them stand in the same tick, split the vote and start over
            # half the time; 10 ms ticks cost ~0.3% CPU
            autoTickPeriod=0.01,
            connectionRetryTime=0.5,
            leaderFallbackTimeout=leader_fallback_s,
            # A link that was busy but heard nothing back for this long is dropped and reconnected.
            # Quiet links are not dropped: followers exchange nothing until an election, and the
            # first vote request after a quiet spell used to close the link instead of going out
            # (gcache.meta.raft_guard counts the silence from the first event after a quiet
            # spell). Long, so that a peer stalled by a loaded machine is not cut off; dead peers
            # are found by TCP keepalive (5 s) and by reset connections.
            connectionTimeout=30.0,
            tcp_keepalive=(2, 1, 3),
            dynamicMembershipChange=False,
            logCompactionMinEntries=2000,
            onStateChanged=self._state_changed,
        )
        self.leader_since: float | None = None  # wall time this member last became leader
        self._log = _Log(sm)
        self._obj = SyncObj(self_addr, [p for p in peers if p != self_addr], conf, consumers=[self._log])
        self.self_addr = self_addr

    def _state_changed(self, old: int, new: int) -> None:
        self.leader_since = time.time() if new == RAFT_LEADER else None
        log.debug("raft %s: %s -> %s", self.self_addr, STATES[old], STATES[new])

    @property
    def is_leader(self) -> bool:
        return bool(self._obj._isLeader())

    @property
    def applied_all_committed(self) -> bool:
        """This member leads and has applied every entry committed before it led (pysyncobj's
        no-op of its term is applied): its state machine then holds every command whose result
        any proposer has had, so what it does not hold no caller can have been told of."""
        obj = self._obj
        noop = getattr(obj, "_SyncObj__noopIDx", None)  # private; without it this cannot tell
        return bool(obj._isLeader()) and isinstance(noop, int) and obj.raftLastApplied >= noop

    @property
    def leader(self) -> str | None:
        """The leader as this member knows it: itself, or the leader it is connected to and has
        heard from within an election timeout; else None. pysyncobj keeps a follower's last
        leader for as long as the follower is cut off from everyone (it starts no election then),
        so a master that had lost its quorum went on naming a dead leader, and its readiness,
        its has_leader metric and `gcache health` said the group was fine."""
        obj = self._obj
        leader = obj._getLeader()
        if leader is None:
            return None
        if not obj._isLeader():
            heard_by = getattr(obj, "_SyncObj__raftElectionDeadline", None)  # moved on by each append
            if (isinstance(heard_by, float) and heard_by < time.monotonic()) or not obj.isNodeConnected(leader):
                return None
        return str(leader.address if hasattr(leader, "address") else leader)

    def status(self) -> dict[str, Any]:
        st = self._obj.getStatus()
        return {"self": self.self_addr, "leader": self.leader, "is_leader": self.is_leader,
                "term": st.get("raft_term"), "commit_idx": st.get("commit_idx"), "leader_since": self.leader_since}

    def propose(self, cmd: dict[str, Any], timeout_s: float = 3.0) -> dict[str, Any]:
        """Commit ``cmd`` and return the state machine's result; retried through elections
        until the deadline. Raises ValueError for a command the state machine refused."""
        blob = msgpack.packb(cmd)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ProposalFailed(f"not committed within {timeout_s}s: {last}")
            try:
                out = msgpack.unpackb(self._log.apply(blob, sync=True, timeout=min(remaining, 1.0)))
            except SyncObjException as exc:
                last = exc
                time.sleep(0.02)  # an election is in progress; try again shortly
                continue
            if "error" in out:
                raise ValueError(out["error"])
            result: dict[str, Any] = out["ok"]
            return result

    def close(self) -> None:
        self._obj.destroy()

