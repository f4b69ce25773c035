"""The one Mooncake trace reader (gcache.mooncake_trace), on small hand-made trace files: its
units, the meaning of ``limit``, and the errors that name the line."""

import json

import pytest

from gcache.mooncake_trace import BLOCK_TOKENS, TraceError, TraceRequest, load_trace, parse_line


def line(ts, tokens, ids, out=7):
    return json.dumps({"timestamp": ts, "input_length": tokens, "output_length": out, "hash_ids": ids})


@pytest.fixture
def trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([
        line(0, 512, [1]),             # exactly one block
        "",                            # blank lines are skipped, not counted
        line(1500, 1100, [1, 2, 3]),   # 512 + 512 + 76 tokens
        "   ",
        line(1500, 10, [9], out=0),    # equal timestamps keep file order
        line(2250, 1024, [1, 2]),
    ]) + "\n")
    return p


def test_units_are_milliseconds_tokens_and_block_ids(trace):
    reqs = load_trace(trace)
    assert reqs[1] == TraceRequest(1500, 1100, 7, (1, 2, 3))
    assert [r.arrival_s for r in reqs] == [0.0, 1.5, 1.5, 2.25]
    assert reqs[1].prefix_tokens(2) == 2 * BLOCK_TOKENS and reqs[1].prefix_tokens(3) == 1100
    assert BLOCK_TOKENS == 512


def test_limit_counts_requests_in_file_order_and_zero_or_none_means_all(trace):
    assert [r.hash_ids for r in load_trace(trace, limit=2)] == [(1,), (1, 2, 3)]
    assert len(load_trace(trace, limit=3)) == 3
    assert len(load_trace(trace)) == len(load_trace(trace, limit=0)) == len(load_trace(trace, limit=99)) == 4
    with pytest.raises(ValueError, match="limit must be >= 0"):
        load_trace(trace, limit=-1)


def test_limit_reads_only_as_far_as_needed(trace):
    with open(trace, "a") as f:
        f.write("this line is not json\n")
    assert len(load_trace(trace, limit=4)) == 4
    with pytest.raises(TraceError, match=r"t\.jsonl line 7: not a Mooncake trace record"):
        load_trace(trace)


def test_block_tokens_sets_the_expected_number_of_ids(tmp_path):
    p = tmp_path / "small_blocks.jsonl"
    p.write_text(line(0, 130, [1, 2, 3]) + "\n")
    assert load_trace(p, block_tokens=64)[0].prefix_tokens(2, 64) == 128
    with pytest.raises(TraceError, match="line 1: 3 hash_ids for 130 tokens .expected 1 blocks of 512"):
        load_trace(p)
    with pytest.raises(ValueError, match="block_tokens"):
        load_trace(p, block_tokens=0)


def test_a_trace_must_be_in_arrival_order(tmp_path):
    p = tmp_path / "back.jsonl"
    p.write_text(line(1000, 10, [1]) + "\n" + line(999, 10, [2]) + "\n")
    with pytest.raises(TraceError, match="line 2: timestamp 999 is earlier"):
        load_trace(p)
    assert len(load_trace(p, limit=1)) == 1  # the first request alone is in order


@pytest.mark.parametrize("bad, why", [
    ('{"timestamp": 0, "input_length": 10}', "hash_ids"),
    ('{"timestamp": "0", "input_length": 10, "hash_ids": [1]}', "timestamp must be a number"),
    ('{"timestamp": 0, "input_length": 10, "hash_ids": ["1"]}', "not an integer"),
    ('{"timestamp": 0, "input_length": true, "hash_ids": [1]}', "not an integer"),
    ('{"timestamp": 0, "input_length": 10.5, "hash_ids": [1]}', "not an integer"),
    ('{"timestamp": 0, "input_length": -1, "hash_ids": []}', "must be >= 0"),
    ('[1, 2]', "not a Mooncake trace record"),
    ("not json", "not a Mooncake trace record"),
])
def test_bad_lines_are_trace_errors_naming_the_line(bad, why):
    with pytest.raises(TraceError, match=f"trace line 5: .*{why}"):
        parse_line(bad, 5)
    assert issubclass(TraceError, ValueError)


def test_output_length_is_optional_and_fractional_timestamps_are_kept():
    assert parse_line('{"timestamp": 2.5, "input_length": 0, "hash_ids": []}') == TraceRequest(2.5, 0, 0, ())


def test_gcache_bench_and_router_sim_read_through_this_reader(trace):
    import gcache.bench.trace as bench_trace
    import router.sim.cli as sim_cli
    from router.sim.synthetic import hot_prefix

    assert bench_trace.load_trace is load_trace and bench_trace.TraceRequest is TraceRequest
    assert sim_cli.load_trace is load_trace
    assert [r.arrival_s for r in hot_prefix(n=3, rate_per_s=4.0)] == [0.0, 0.25, 0.5]
    assert isinstance(hot_prefix(n=1)[0], TraceRequest)
