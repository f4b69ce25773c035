"""Trace parsing and prefix-hit arithmetic, on tiny hand-made traces with exact answers."""

import json
import os

import pytest

from gcache.bench.trace import (
    HitAccounting,
    TraceError,
    TraceRequest,
    leading_hits,
    load_trace,
    parse_line,
    trace_max,
    working_set_blocks,
)

SHARED_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "conversation_trace.jsonl")


def line(ts, n_tokens, ids, out=10):
    return json.dumps({"timestamp": ts, "input_length": n_tokens, "output_length": out, "hash_ids": ids})


def test_parse_line_reads_fields_and_checks_block_count():
    r = parse_line(line(1500, 1100, [4, 5, 6]))
    assert r == TraceRequest(1500, 1100, 10, (4, 5, 6))
    with pytest.raises(TraceError, match="line 7: 2 hash_ids for 1100 tokens"):
        parse_line(line(0, 1100, [4, 5]), 7)
    with pytest.raises(TraceError, match="line 3"):
        parse_line('{"timestamp": 0}', 3)
    with pytest.raises(TraceError, match="line 4"):
        parse_line("not json", 4)


def test_load_trace_limit_and_blank_lines(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([line(0, 512, [1]), "", line(5, 600, [1, 2]), line(9, 10, [3])]) + "\n")
    assert [r.hash_ids for r in load_trace(str(p))] == [(1,), (1, 2), (3,)]
    assert len(load_trace(str(p), limit=2)) == 2


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
