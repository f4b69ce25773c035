"""Routing policies: exact choices on tiny candidate sets."""

from __future__ import annotations

import pytest

from router.config import PolicyConfig
from router.policies import POLICIES, Candidate, Reason, RouteInput, make_policy

CFG = PolicyConfig(match_weight=1.5, min_match_blocks=2, load_floor_tokens=1000, decode_tokens_per_request=0,
                   balance_abs_threshold=2, balance_rel_threshold=1.5, cache_threshold=0.3)


def C(name, matched=0, reqs=0, tokens=0):
    return Candidate(name, matched, reqs, tokens)


def test_registry_and_unknown_policy():
    assert set(POLICIES) == {"round_robin", "least_load", "sglang", "gcache"}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def test_round_robin_cycles_by_ticket():
    p = make_policy("round_robin", CFG)
    cands = [C("a"), C("b"), C("c")]
    assert [p.choose(RouteInput(1, 10, t), cands).worker for t in range(6)] == list("abcabc")


def test_least_load_uses_tokens_then_requests_then_spreads_ties_by_request():
    p = make_policy("least_load", CFG)
    assert p.choose(RouteInput(1, 10), [C("a", tokens=50), C("b", tokens=10), C("c", tokens=10, reqs=1)]).worker == "b"
    idle = [C(n) for n in "abcd"]
    picks = [p.choose(RouteInput(1, 10, key=k), idle).worker for k in range(40)]
    assert len(set(picks)) == 4  # idle workers share new requests
    assert picks == [p.choose(RouteInput(1, 10, key=k), idle[::-1]).worker for k in range(40)]


def test_gated_policy_three_branches():
    p = make_policy("sglang", CFG)
    # imbalance (6-1 > 2 and 6 > 1.5) -> least requests, cache ignored
    d = p.choose(RouteInput(10, 100), [C("a", matched=9, reqs=6), C("b", reqs=1)])
    assert (d.worker, d.reason) == ("b", Reason.IMBALANCE)
    # balanced, best match 5/10 >= 0.3 -> best match
    d = p.choose(RouteInput(10, 100), [C("a", matched=5, reqs=2), C("b", reqs=1)])
    assert (d.worker, d.reason) == ("a", Reason.CACHE_MATCH)
    # balanced, best match 2/10 < 0.3 -> least load
    d = p.choose(RouteInput(10, 100), [C("a", matched=2, reqs=2), C("b", reqs=1)])
    assert (d.worker, d.reason) == ("b", Reason.NO_MATCH)


def test_gcache_score_affinity_vs_load_and_shared_prefix():
    p = make_policy("gcache", CFG)
    # a shared 1-block system prompt (below min_match_blocks) does not attract traffic
    d = p.choose(RouteInput(10, 100), [C("a", matched=1, tokens=500), C("b", tokens=0)])
    assert (d.worker, d.reason) == ("b", Reason.SCORE_LOAD)
    # a long match beats a moderate load difference: 1.5*0.8 - 0.5 > 0
    d = p.choose(RouteInput(10, 100), [C("a", matched=8, tokens=500), C("b", tokens=0)])
    assert (d.worker, d.reason) == ("a", Reason.SCORE_AFFINITY)
    # ...but not a saturated worker: 1.5*0.3 - 1.0 < 0
    d = p.choose(RouteInput(10, 100), [C("a", matched=3, tokens=4000), C("b", tokens=0)])
    assert d.worker == "b"
    s = p.scores(RouteInput(10, 100), [C("a", matched=3, tokens=4000), C("b", tokens=0)])
    assert s == pytest.approx({"a": 1.5 * 0.3 - 1.0, "b": 0.0})


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_choice_does_not_depend_on_candidate_order(name):
    p = make_policy(name, CFG)
    cands = [C("a", 3, 1, 100), C("b", 3, 1, 100), C("c", 0, 0, 0), C("d", 5, 2, 300)]
    first = p.choose(RouteInput(10, 100, 7), sorted(cands, key=lambda c: c.name))
    again = p.choose(RouteInput(10, 100, 7), sorted(cands, key=lambda c: c.name))
    assert first == again
    if name != "round_robin":  # round-robin indexes the name-sorted list by design
        assert p.choose(RouteInput(10, 100, 7), list(reversed(cands))) == first
