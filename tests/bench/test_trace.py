"""Prefix-hit arithmetic, on tiny hand-made traces with exact answers (the reader itself:
tests/test_mooncake_trace.py)."""

import os

import pytest

from gcache.bench.trace import (
    HitAccounting,
    TraceRequest,
    leading_hits,
    load_trace,
    trace_max,
    working_set_blocks,
)

SHARED_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "conversation_trace.jsonl")


def test_leading_hits_stops_at_first_hole():
    assert leading_hits([]) == 0
    assert leading_hits([True, True, False, True]) == 2
    assert leading_hits([False, True]) == 0
    assert leading_hits([True] * 3) == 3


def test_partial_last_block_counts_its_own_tokens():
    acc = HitAccounting(window_s=10)
    req = TraceRequest(0, 1100, 0, (1, 2, 3))  # blocks of 512, 512, 76 tokens
    assert acc.add(req, 0) == 0
    assert acc.add(req, 2) == 1024
    assert acc.add(req, 3) == 1100
    assert acc.hit_rate == pytest.approx(2124 / 3300)
    with pytest.raises(ValueError):
        acc.add(req, 4)


def test_trace_max_is_prefix_only_in_arrival_order():
    reqs = [
        TraceRequest(0, 1024, 0, (0, 1)),        # nothing seen: 0
        TraceRequest(1000, 1536, 0, (0, 1, 2)),  # 0,1 seen: 1024
        TraceRequest(2000, 1024, 0, (0, 9)),     # 0 seen, 9 new: 512
        TraceRequest(61000, 1024, 0, (7, 1)),    # 7 new, so 1 (seen) does not count: 0
        TraceRequest(62000, 600, 0, (0, 9)),     # both seen; last block 88 tokens: 600
    ]
    acc = trace_max(reqs)
    assert acc.hit_tokens == 1024 + 512 + 600
    assert acc.input_tokens == 1024 + 1536 + 1024 + 1024 + 600
    assert acc.series() == [[0.0, pytest.approx(1536 / 3584)], [60.0, pytest.approx(600 / 1624)]]
    assert working_set_blocks(reqs) == 5


@pytest.mark.skipif(not os.path.exists(SHARED_TRACE), reason="shared conversation trace not present")
def test_shared_trace_maximum_matches_its_readme():
    reqs = load_trace(SHARED_TRACE)
    assert len(reqs) == 12031
    assert trace_max(reqs).hit_rate == pytest.approx(0.374, abs=0.0005)
