"""Routing policies: one class each, picked by name from ``POLICIES``.

A policy is a pure function of (request, candidates): no clock, no randomness,
no I/O, ties broken by a hash of (request, worker name). Two router replicas that see the same
state therefore make the same choice. The round-robin position comes from a
shared ticket (a Redis counter, or a local one in memory mode).

Load. A worker's load is measured in tokens of outstanding work::

    load(w) = pending_prefill_tokens(w) + decode_tokens_per_request * inflight_requests(w)

pending_prefill_tokens are the uncached tokens of requests sent to w whose first
response byte has not come back yet (they are still prefilling); every in-flight
request also costs some decode work. The gcache score normalises it by the most
loaded candidate, with a floor so near-idle fleets are not called imbalanced::

    normalized_load(w) = load(w) / max(max_v load(v), load_floor_tokens)      in [0, 1]
    score(w) = match_weight * match_fraction(w) - normalized_load(w)

match_fraction(w) = matched_blocks(w) / request_blocks, counted as 0 when
matched_blocks(w) < min_match_blocks (a shared system prompt is not affinity).
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
    SCORE_AFFINITY = "score_affinity"  # gcache score picked a worker with a usable match
    SCORE_LOAD = "score_load"  # gcache score picked on load alone (no usable match anywhere)
    ENCODER_AFFINITY = "encoder_affinity"


@dataclass(frozen=True)
class Candidate:
    """One eligible worker as a policy sees it."""

    name: str
    matched_blocks: int
    inflight_requests: int
    pending_tokens: int


@dataclass(frozen=True)
class RouteInput:
    """What a policy knows about the request."""

    n_blocks: int
    n_tokens: int
    ticket: int = 0  # shared monotonically increasing counter, for round-robin
    key: int = 0  # request identity (its last block hash): spreads ties deterministically


@dataclass(frozen=True)
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

    def load(self, c: Candidate) -> int:
        return c.pending_tokens + self.cfg.decode_tokens_per_request * c.inflight_requests

    def least_loaded(self, cands: Sequence[Candidate], key: int = 0) -> Candidate:
        return min(cands, key=lambda c: (self.load(c), c.inflight_requests, -c.matched_blocks, tiebreak(c.name, key)))

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        raise NotImplementedError


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        c = cands[req.ticket % len(cands)]
        return Decision(c.name, Reason.ROUND_ROBIN, c.matched_blocks)


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        c = self.least_loaded(cands, req.key)
        return Decision(c.name, Reason.LEAST_LOAD, c.matched_blocks)


class GatedCacheAware(Policy):
    """SGLang's cache-aware router: imbalance -> least load; else best match above a
    threshold; else least load. Load here is in-flight requests, as in SGLang."""

    name = "sglang"

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        loads = [c.inflight_requests for c in cands]
        lo, hi = min(loads), max(loads)
        by_req = min(cands, key=lambda c: (c.inflight_requests, tiebreak(c.name, req.key)))
        if hi - lo > self.cfg.balance_abs_threshold and hi > lo * self.cfg.balance_rel_threshold:
            return Decision(by_req.name, Reason.IMBALANCE, by_req.matched_blocks)
        best = min(cands, key=lambda c: (-c.matched_blocks, c.inflight_requests, tiebreak(c.name, req.key)))
        frac = best.matched_blocks / req.n_blocks if req.n_blocks else 0.0
        if best.matched_blocks > 0 and frac >= self.cfg.cache_threshold:
            return Decision(best.name, Reason.CACHE_MATCH, best.matched_blocks)
        return Decision(by_req.name, Reason.NO_MATCH, by_req.matched_blocks)


class GcacheScore(Policy):
    """``score = match_weight * match_fraction - normalized_load``; highest score wins."""

    name = "gcache"

    def match_fraction(self, req: RouteInput, c: Candidate) -> float:
        if req.n_blocks == 0 or c.matched_blocks < max(1, self.cfg.min_match_blocks):
            return 0.0
        return c.matched_blocks / req.n_blocks

    def scores(self, req: RouteInput, cands: Sequence[Candidate]) -> dict[str, float]:
        norm = max(max(self.load(c) for c in cands), self.cfg.load_floor_tokens)
        return {
            c.name: self.cfg.match_weight * self.match_fraction(req, c) - self.load(c) / norm for c in cands
        }

    def choose(self, req: RouteInput, cands: Sequence[Candidate]) -> Decision:
        s = self.scores(req, cands)
        best = min(cands, key=lambda c: (-s[c.name], c.inflight_requests, tiebreak(c.name, req.key)))
        reason = Reason.SCORE_AFFINITY if self.match_fraction(req, best) > 0 else Reason.SCORE_LOAD
        return Decision(best.name, reason, best.matched_blocks)


def tiebreak(name: str, key: int) -> tuple[int, str]:
    """Rendezvous hash of (request, worker): equal candidates are spread over workers
    by request, the same way on every replica, instead of always picking the first name."""
    return (xxhash.xxh3_64_intdigest(name.encode(), seed=key & 0xFFFFFFFFFFFFFFFF), name)


POLICIES: dict[str, type[Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoad.name: LeastLoad,
    GatedCacheAware.name: GatedCacheAware,
    GcacheScore.name: GcacheScore,
}


def make_policy(name: str, cfg: PolicyConfig | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return cls(cfg or PolicyConfig())
