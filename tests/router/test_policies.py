"""Routing policies: exact choices on tiny candidate sets."""

from __future__ import annotations

import pytest

from router.config import PolicyConfig
from router.cost import PrefillCost
from router.policies import POLICIES, Candidate, Reason, RouteInput, make_policy

CFG = PolicyConfig(inflight_penalty_ms=0, balance_abs_threshold=2, balance_rel_threshold=1.5, cache_threshold=0.3)
COST = PrefillCost()


def C(name, matched=0, reqs=0, pending=0, uncached=0, age_ms=float("inf"), speed=1.0):
    return Candidate(name, matched, reqs, pending, uncached, 0, speed, age_ms)


def test_registry_and_unknown_policy():
    assert set(POLICIES) == {"round_robin", "least_load", "sglang", "min_ttft"}
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def test_round_robin_cycles_by_ticket():
    p = make_policy("round_robin", CFG)
    cands = [C("a"), C("b"), C("c")]
    assert [p.choose(RouteInput(1, 10, t), cands).worker for t in range(6)] == list("abcabc")


def test_least_load_uses_work_per_speed_then_requests_then_spreads_ties_by_request():
    p = make_policy("least_load", CFG)
    assert p.choose(RouteInput(1, 10), [C("a", pending=50), C("b", pending=10), C("c", pending=10, reqs=1)]).worker == "b"
    assert p.choose(RouteInput(1, 10), [C("a", pending=50, speed=10), C("b", pending=10)]).worker == "a"
    idle = [C(n) for n in "abcd"]
    picks = [p.choose(RouteInput(1, 10, key=k), idle).worker for k in range(40)]
    assert len(set(picks)) == 4  # idle workers share new requests
    assert picks == [p.choose(RouteInput(1, 10, key=k), idle[::-1]).worker for k in range(40)]


def test_gated_policy_three_branches():
    p = make_policy("sglang", CFG)

    def G(name, held, reqs):  # a 100-token prompt, ``held`` of it on the worker
        return C(name, held // 10, reqs, 0, 100 - held)
    # imbalance (6-1 > 2 and 6 > 1.5) -> least requests, cache ignored
    d = p.choose(RouteInput(10, 100), [G("a", 90, 6), G("b", 0, 1)])
    assert (d.worker, d.reason) == ("b", Reason.IMBALANCE)
    # balanced, match rate 50/100 >= 0.3 -> best match
    d = p.choose(RouteInput(10, 100), [G("a", 50, 2), G("b", 0, 1)])
    assert (d.worker, d.reason) == ("a", Reason.CACHE_MATCH)
    # balanced, match rate 20/100 < 0.3 -> least load
    d = p.choose(RouteInput(10, 100), [G("a", 20, 2), G("b", 0, 1)])
    assert (d.worker, d.reason) == ("b", Reason.NO_MATCH)


# A 20-block (10K-token) prompt whose first 18 blocks worker "a" holds.
WARM, COLD = 1024, 10240
DELTA = COST.ms(COLD) - COST.ms(WARM)  # the prefill a spill repeats


def test_min_ttft_scores_are_ttft_plus_the_charged_spill():
    p = make_policy("min_ttft", CFG)
    cands = [C("a", 18, pending=300, uncached=WARM), C("b", pending=100, uncached=COLD)]
    k = CFG.affinity_weight + 100 / CFG.busy_scale_ms  # the other worker's mean pending work
    assert p.scores(cands) == pytest.approx({"a": 300 + COST.ms(WARM), "b": 100 + COST.ms(COLD) + k * DELTA})
    assert p.choose(RouteInput(20, COLD), cands) == p.choose(RouteInput(20, COLD), cands[::-1])


def test_min_ttft_affinity_is_bounded_by_what_it_saves():
    p = make_policy("min_ttft", CFG)
    bound = CFG.affinity_weight * DELTA + DELTA  # idle elsewhere: k = affinity_weight
    d = p.choose(RouteInput(20, COLD), [C("a", 18, pending=int(bound) - 5, uncached=WARM), C("b", uncached=COLD)])
    assert (d.worker, d.reason) == ("a", Reason.WARM)
    d = p.choose(RouteInput(20, COLD), [C("a", 18, pending=int(bound) + 5, uncached=WARM), C("b", uncached=COLD)])
    assert (d.worker, d.reason) == ("b", Reason.SPILL)
    d = p.choose(RouteInput(20, COLD), [C("a", uncached=COLD), C("b", pending=1, uncached=COLD)])
    assert (d.worker, d.reason) == ("a", Reason.COLD)


def test_min_ttft_hot_prefix_spills_once_its_queue_exceeds_a_cold_prefill():
    p = make_policy("min_ttft", CFG)
    # the prefix was last requested 10 ms ago: its warm prefill is more than half that interval
    hot = {"matched": 18, "uncached": WARM, "age_ms": 10.0}
    d = p.choose(RouteInput(20, COLD), [C("a", pending=int(DELTA) - 5, **hot), C("b", uncached=COLD)])
    assert d.worker == "a"
    d = p.choose(RouteInput(20, COLD), [C("a", pending=int(DELTA) + 5, **hot), C("b", uncached=COLD)])
    assert (d.worker, d.reason) == ("b", Reason.SPILL)
    # the same queue on a prefix last requested a minute ago keeps it on its owner
    d = p.choose(RouteInput(20, COLD), [C("a", pending=int(DELTA) + 5, matched=18, uncached=WARM, age_ms=60_000),
                                        C("b", uncached=COLD)])
    assert d.worker == "a"


def test_min_ttft_normalises_load_by_worker_speed():
    p = make_policy("min_ttft", CFG)
    cands = [C("a", pending=1000, uncached=COLD, speed=4.0), C("b", pending=400, uncached=COLD)]
    assert p.choose(RouteInput(20, COLD), cands).worker == "a"  # (1000 + cold) / 4 < 400 + cold


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_choice_does_not_depend_on_candidate_order(name):
    p = make_policy(name, CFG)
    cands = [C("a", 3, 1, 100, 700), C("b", 3, 1, 100, 700), C("c", 0, 0, 0, 2000), C("d", 5, 2, 300, 0)]
    first = p.choose(RouteInput(10, 2000, 7), sorted(cands, key=lambda c: c.name))
    again = p.choose(RouteInput(10, 2000, 7), sorted(cands, key=lambda c: c.name))
    assert first == again
    if name != "round_robin":  # round-robin indexes the name-sorted list by design
        assert p.choose(RouteInput(10, 2000, 7), list(reversed(cands))) == first
