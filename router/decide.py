"""One routing decision, shared by the proxy and the simulator.

Pure: from a state snapshot, pick the length bucket's eligible workers, drop
unhealthy and full ones, and ask the policy. The caller does the I/O (acquire
the lease, forward the request, or queue it).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.buckets import BucketMap
from router.policies import Candidate, Decision, Policy, RouteInput
from router.state_base import WorkerState


class Outcome(enum.Enum):
    ROUTED = "routed"
    FULL = "full"  # eligible workers exist but all are at max_inflight: wait in the queue
    NO_WORKER = "no_worker"  # no healthy worker can serve this length: fail now
    NO_MODEL = "no_model"  # no worker at all serves the requested model


# not frozen: built per request, and a frozen dataclass costs several times as much to build
@dataclass(slots=True)
class Plan:
    outcome: Outcome
    bucket: int
    decision: Decision | None = None
    uncached_tokens: int = 0  # on the chosen worker (ROUTED) or the best eligible one (FULL)
    work_ms: int = 0  # estimated prefill work the chosen worker is charged (ROUTED)


def plan(
    policy: Policy,
    buckets: BucketMap,
    states: Sequence[WorkerState],
    n_tokens: int,
    n_blocks: int,
    block_tokens: int,
    ticket: int = 0,
    key: int = 0,
    l3_tokens: int = 0,
    exclude: frozenset[str] = frozenset(),
    model: str | None = None,
    exact: Mapping[str, int] | None = None,
) -> Plan:
    """``l3_tokens``: leading prompt tokens any worker can load from the shared L3 tier; ``exclude``: workers not to use (already tried for this request); ``model``: only
    workers serving it (WorkerSpec.serves); ``exact``: prompt tokens a worker holds according
    to its own KV events, which replace the approximate index's guess for that worker."""
    group_all = [s for s in states if s.spec.role == "llm" and (model is None or s.spec.serves(model))]
    if model is not None and not group_all:
        return Plan(Outcome.NO_MODEL, 0)
    llm = [s for s in group_all if s.healthy and not s.circuit_open and (not exclude or s.name not in exclude)]
    bucket, names = buckets.group(n_tokens, llm)
    if not names:
        return Plan(Outcome.NO_WORKER, bucket)
    allowed = set(names)
    group = llm if len(names) == len(llm) else [s for s in llm if s.name in allowed]
    exact = exact or {}
    # prompt tokens each worker holds
    held = [min(n_tokens, s.matched_blocks * block_tokens if (t := exact.get(s.name)) is None else t)
            for s in group] if exact else [min(n_tokens, s.matched_blocks * block_tokens) for s in group]
    l3_tokens = min(n_tokens, l3_tokens)
    best = max(max(held), l3_tokens)
    cands = []
    for s, h in zip(group, held, strict=True):
        if s.inflight_requests < s.spec.max_inflight:
            cands.append(Candidate(s.name, h // block_tokens, s.inflight_requests, s.pending_ms, n_tokens - h,
                                   max(0, l3_tokens - h), s.spec.speed, s.match_age_s * 1000.0))
    if not cands:
        return Plan(Outcome.FULL, bucket, None, n_tokens - best)
    d = policy.choose(RouteInput(n_blocks, n_tokens, ticket, key), cands)
    c = next(c for c in cands if c.name == d.worker)
    work = policy.cfg.cost.work(c.uncached_tokens - c.l3_tokens, c.l3_tokens)
    return Plan(Outcome.ROUTED, bucket, d, c.uncached_tokens - c.l3_tokens, work)
