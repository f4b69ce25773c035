"""Routing policies: one class each, picked by name from ``POLICIES``.

A policy is a pure function of (request, candidates): no clock, no randomness,
no I/O, ties broken by a hash of (request, worker name). Two router replicas that see the same
state therefore make the same choice. The round-robin position comes from a
shared ticket (a Redis counter, or a local one in memory mode).

Load. A worker's load is kept as *pending prefill work*: the estimated prefill time
(``router.cost.PrefillCost``, milliseconds on the reference worker) of every request
sent to it that has not produced its first response byte yet.

min_ttft estimates each worker's time to first token, plus what a spill costs the fleet::

    own(w)   = prefill_ms(uncached_tokens(w))            # tokens w does not hold
    ttft(w)  = (pending_ms(w) + own(w)) / speed(w) + inflight_penalty_ms * inflight(w)
    score(w) = ttft(w) + k * (own(w) - min_v own(v))     # lowest score wins
    k        = affinity_weight + mean pending_ms of the other workers / busy_scale_ms

The second term charges the redundant prefill a spill adds (recomputing a prefix another
worker holds): it pollutes caches and delays whoever queues behind it, more so the busier
the fleet. Affinity is therefore worth at most k times the prefill it saves, while the
queue term grows without bound: a prefix stays on its owner only until the owner's queue
costs more than that. A *hot* prefix, one requested so often that it alone keeps its
owner busy (``own(owner) >= hot_load * time since its last matched block was last
requested``), gets k = 0: it spills as soon as its owner's queue exceeds what a cold
prefill elsewhere costs, and the worker it spills to holds a second copy from then on.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from router.config import PolicyConfig


class Reason(enum.Enum):
    """Why a worker was chosen (a Prometheus label)."""

    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    IMBALANCE = "imbalance"  # gated policy: load spread too wide, cache ignored
    CACHE_MATCH = "cache_match"  # gated policy: best match above cache_threshold
    NO_MATCH = "no_match"  # gated policy: best match below threshold -> least load
    WARM = "warm"  # min_ttft: the chosen worker holds the longest match there is
    SPILL = "spill"  # min_ttft: a worker with a longer match was too busy; the prefix is replicated
    COLD = "cold"  # min_ttft: no worker holds any of the prompt
    ENCODER_AFFINITY = "encoder_affinity"


# not frozen: built per request, and a frozen dataclass costs several times as much to build
@dataclass(slots=True)
class Candidate:
    """One eligible worker as a policy sees it."""

    name: str
    matched_blocks: int
    inflight_requests: int
    pending_ms: int
    uncached_tokens: int = 0
    l3_tokens: int = 0  # of the uncached tokens, how many it could load from the shared L3 tier
    speed: float = 1.0
    match_age_ms: float = float("inf")


# not frozen: built per request, and a frozen dataclass costs several times as much to build
@dataclass(slots=True)
class RouteInput:
    """What a policy knows about the request."""

    n_blocks: int
    n_tokens: int
    ticket: int = 0  # shared monotonically increasing counter, for round-robin
    key: int = 0  # request identity (its last block hash): spreads ties deterministically


# not frozen: built per request, and a frozen dataclass costs several times as much to build
@dataclass(slots=True)
class Decision:
    worker: str
    reason: Reason
    matched_blocks: int


class Policy:
    """Base class: ``choose`` gets a non-empty candidate list sorted by name."""

    name = "base"

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cfg})"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        c = cands[req.ticket % len(cands)]
        return Decision(c.name, Reason.ROUND_ROBIN, c.matched_blocks)


class LeastLoad(Policy):
    """Least pending work per unit of speed, then fewest requests; cache ignored."""

    name = "least_load"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        c = min(cands, key=lambda c: (c.pending_ms / c.speed, c.inflight_requests, tiebreak(c.name, req.key)))
        return Decision(c.name, Reason.LEAST_LOAD, c.matched_blocks)


class GatedCacheAware(Policy):
    """SGLang's cache-aware router: imbalance -> least load; else the best match if its match
    rate (held prompt tokens / prompt tokens) reaches a threshold; else least load. Load here
    is in-flight requests, as in SGLang."""

    name = "sglang"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        loads = [c.inflight_requests for c in cands]
        lo, hi = min(loads), max(loads)
        by_req = min(cands, key=lambda c: (c.inflight_requests, tiebreak(c.name, req.key)))
        if hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold:
            return Decision(by_req.name, Reason.IMBALANCE, by_req.matched_blocks)
        best = min(cands, key=lambda c: (c.uncached_tokens, c.inflight_requests, tiebreak(c.name, req.key)))
        held = req.n_tokens - best.uncached_tokens
        if held > 0 and held >= self.cfg.cache_threshold * req.n_tokens:
            return Decision(best.name, Reason.CACHE_MATCH, best.matched_blocks)
        return Decision(by_req.name, Reason.NO_MATCH, by_req.matched_blocks)


class MinTTFT(Policy):
    """Lowest estimated time to first token plus the fleet's cost of a spill (module docstring)."""

    name = "min_ttft"

    def own_ms(self, c: Candidate) -> float:
        return self.cfg.cost.ms(c.uncached_tokens - c.l3_tokens, c.l3_tokens)

    def scores(self, cands: Sequence[Candidate]) -> dict[str, float]:
        return {c.name: s for c, s in zip(cands, self._scores(cands), strict=True)}

    def _scores(self, cands: Sequence[Candidate]) -> list[float]:
        cfg = self.cfg
        own = [self.own_ms(c) for c in cands]
        least = min(own)
        w = min(range(len(cands)), key=lambda i: (own[i], cands[i].match_age_ms))
        hot = own[w] >= cfg.hot_load * cands[w].match_age_ms
        others = [c.pending_ms / c.speed for i, c in enumerate(cands) if i != w]
        busy = sum(others) / len(others) if others else 0.0
        k = 0.0 if hot else cfg.affinity_weight + busy / cfg.busy_scale_ms
        pen = cfg.inflight_penalty_ms
        return [(c.pending_ms + o) / c.speed + pen * c.inflight_requests + k * (o - least)
                for c, o in zip(cands, own, strict=True)]

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        if len(cands) == 1:
            best = cands[0]
        else:
            s = self._scores(cands)
            lo = min((s[i], c.inflight_requests) for i, c in enumerate(cands))
            tied = [c for i, c in enumerate(cands) if (s[i], c.inflight_requests) == lo]
            # the rendezvous hash only among exact ties (it is the costly part of the key)
            best = tied[0] if len(tied) == 1 else min(tied, key=lambda c: tiebreak(c.name, req.key))
        longest = max(c.matched_blocks for c in cands)
        if longest == 0:
            reason = Reason.COLD
        elif best.matched_blocks == longest:
            reason = Reason.WARM
        else:
            reason = Reason.SPILL
        return Decision(best.name, reason, best.matched_blocks)


def tiebreak(name: str, key: int) -> tuple[int, str]:
    """Rendezvous hash of (request, worker): equal candidates are spread over workers
    by request, the same way on every replica, instead of always picking the first name."""
    return (xxhash.xxh3_64_intdigest(name.encode(), seed=key & 0xFFFFFFFFFFFFFFFF), name)


POLICIES: dict[str, type[Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoad.name: LeastLoad,
    GatedCacheAware.name: GatedCacheAware,
    MinTTFT.name: MinTTFT,
}


def make_policy(name: str, cfg: PolicyConfig | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(cfg or PolicyConfig())
