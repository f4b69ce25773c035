"""The leader's failure detector with an injected clock: suspect / down thresholds, grace
periods for a new leader and a new incarnation, and nodes that leave."""

from __future__ import annotations

import pytest

from gcache.errors import ConfigError
from gcache.meta.detector import FailureDetector


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def fd(clock):
    return FailureDetector(suspect_after_s=2.0, down_after_s=3.0, clock=clock, pause_s=None)  # steps of seconds


def verdicts(fd, rows):
    return [(v.node, v.inc, v.state) for v in fd.verdicts(rows)]


def test_only_the_leader_judges(fd, clock):
    fd.heard("a", 1)
    clock.t += 10
    assert verdicts(fd, [("a", 1, "up")]) == []
    assert fd.leadership(True) is True and fd.leadership(True) is False


def test_silence_makes_suspect_then_down_and_a_heartbeat_brings_back_up(fd, clock):
    fd.leadership(True)
    fd.heard("a", 1)
    fd.heard("b", 1)
    script = [  # (advance, who heartbeats, table states, expected verdicts)
        (1.9, ["a"], {"a": "up", "b": "up"}, []),
        (0.2, ["a"], {"a": "up", "b": "up"}, [("b", 1, "suspect")]),
        (0.5, ["a"], {"a": "up", "b": "suspect"}, []),
        (0.5, ["a"], {"a": "up", "b": "suspect"}, [("b", 1, "down")]),
        (5.0, ["a"], {"a": "up", "b": "down"}, []),  # DOWN nodes are not judged again
    ]
    for advance, beat, states, want in script:
        clock.t += advance
        for n in beat:
            fd.heard(n, 1)
        assert verdicts(fd, [(n, 1, s) for n, s in states.items()]) == want
    clock.t += 0.1
    fd.heard("a", 1)
    clock.t += 2.5
    assert verdicts(fd, [("a", 1, "up")]) == [("a", 1, "suspect")]
    fd.heard("a", 1)
    assert verdicts(fd, [("a", 1, "suspect")]) == [("a", 1, "up")]


def test_a_new_leader_gives_everyone_a_full_grace_period(fd, clock):
    fd.heard("a", 1)  # heard long before this master led
    clock.t += 60
    fd.leadership(True)
    clock.t += 2.9
    assert verdicts(fd, [("a", 1, "up")]) == [("a", 1, "suspect")]
    clock.t += 0.2
    assert verdicts(fd, [("a", 1, "suspect")]) == [("a", 1, "down")]
    # losing leadership and winning it again restarts the grace period
    fd.leadership(False)
    assert verdicts(fd, [("a", 1, "up")]) == []
    fd.leadership(True)
    clock.t += 1.0
    assert verdicts(fd, [("a", 1, "up")]) == []


def test_an_incarnation_not_heard_yet_gets_a_grace_period(fd, clock):
    fd.leadership(True)
    fd.heard("a", 1)
    clock.t += 10
    # a re-registered through another master: incarnation 2 is new here
    assert verdicts(fd, [("a", 2, "up")]) == []
    clock.t += 2.5
    assert verdicts(fd, [("a", 2, "up")]) == [("a", 2, "suspect")]
    # a late heartbeat of the old incarnation does not count for the new one
    fd.heard("a", 1)
    clock.t += 0.6
    assert verdicts(fd, [("a", 2, "suspect")]) == [("a", 2, "down")]


def test_down_nodes_are_ignored_and_departed_nodes_forgotten(fd, clock):
    fd.leadership(True)
    for n in ("b", "c"):
        fd.heard(n, 1)
    clock.t += 10
    assert verdicts(fd, [("b", 1, "down"), ("c", 1, "up")]) == [("c", 1, "down")]
    assert set(fd.ages()) == {"b", "c"}
    fd.verdicts([("c", 1, "up")])
    assert set(fd.ages()) == {"c"} and fd.ages()["c"] == pytest.approx(10.0)


def test_a_draining_node_is_only_ever_removed_when_silent(fd, clock):
    """A draining node owns nothing, so suspicion means nothing for it; but its handover waits
    for its report, so one that hangs must be declared down (before: never judged, and a hung
    draining node held the handover, and every read of its keys, open until it resumed)."""
    fd.leadership(True)
    fd.heard("a", 1)
    clock.t += 2.5  # past the suspect threshold
    assert verdicts(fd, [("a", 1, "draining")]) == []
    fd.heard("a", 1)  # heard: its silence starts again
    clock.t += 2.9
    assert verdicts(fd, [("a", 1, "draining")]) == []
    clock.t += 0.2
    assert verdicts(fd, [("a", 1, "draining")]) == [("a", 1, "remove")]  # removed, as a completed drain


def test_thresholds_are_checked():
    with pytest.raises(ConfigError):
        FailureDetector(3.0, 2.0)
    with pytest.raises(ConfigError):
        FailureDetector(0.0, 2.0)


def test_a_leader_that_did_not_run_for_a_while_gives_everyone_a_full_grace_period(clock):
    """A leader paused (SIGSTOP, a VM stall) heard nothing meanwhile and may have been replaced:
    before, it declared every live node DOWN once continued (its verdicts reach the new leader)."""
    fd = FailureDetector(suspect_after_s=2.0, down_after_s=3.0, clock=clock)
    fd.leadership(True)
    fd.heard("a", 1)

    def run(seconds):  # the detector loop: a call every 0.1 s
        out = []
        for _ in range(round(seconds / 0.1)):
            clock.t += 0.1
            out += verdicts(fd, [("a", 1, "up")])
        return out

    assert run(1.0) == []
    clock.t += 4.5  # paused: no calls, no heartbeats
    assert verdicts(fd, [("a", 1, "up")]) == []  # not DOWN
    fd.heard("a", 1)  # heard again soon after
    assert run(1.9) == []
    # a node that really went silent is still judged, after the grace period
    assert run(0.3)[:1] == [("a", 1, "suspect")]
