"""One routing decision, shared by the proxy and the simulator.

Pure: from a state snapshot, pick the length bucket's eligible workers, drop
unhealthy and full ones, and ask the policy. The caller does the I/O (acquire
the lease, forward the request, or queue it).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.buckets import BucketMap
from router.policies import Candidate, Decision, Policy, RouteInput
from router.state_base import WorkerState


class Outcome(enum.Enum):
    ROUTED = "routed"
    FULL = "full"  # eligible workers exist but all are at max_inflight: wait in the queue
    NO_WORKER = "no_worker"  # no healthy worker can serve this length: fail now


@dataclass(frozen=True)
class Plan:
    outcome: Outcome
    bucket: int
    decision: Decision | None = None
    uncached_tokens: int = 0  # on the chosen worker (ROUTED) or the best eligible one (FULL)


def uncached(n_tokens: int, matched_blocks: int, block_tokens: int) -> int:
    return max(0, n_tokens - matched_blocks * block_tokens)


def plan(
    policy: Policy,
    buckets: BucketMap,
    states: Sequence[WorkerState],
    n_tokens: int,
    n_blocks: int,
    block_tokens: int,
    ticket: int = 0,
    key: int = 0,
) -> Plan:
    llm = [s for s in states if s.spec.role == "llm" and s.healthy]
    bucket, names = buckets.group(n_tokens, llm)
    if not names:
        return Plan(Outcome.NO_WORKER, bucket)
    allowed = set(names)
    group = [s for s in llm if s.name in allowed]
    best_match = max(s.matched_blocks for s in group)
    free = [s for s in group if s.inflight_requests < s.spec.max_inflight]
    if not free:
        return Plan(Outcome.FULL, bucket, None, uncached(n_tokens, best_match, block_tokens))
    cands = [Candidate(s.name, s.matched_blocks, s.inflight_requests, s.pending_tokens) for s in free]
    d = policy.choose(RouteInput(n_blocks, n_tokens, ticket, key), cands)
    return Plan(Outcome.ROUTED, bucket, d, uncached(n_tokens, d.matched_blocks, block_tokens))
