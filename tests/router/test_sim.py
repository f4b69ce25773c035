"""The simulator on a 300-request slice of the conversation trace: determinism,
policy and queue-order properties, and the CLI's JSON/PNG output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main
from router.config import QueueConfig, QueueOrder
from router.sim.costmodel import CostModel
from router.sim.engine import SimConfig, simulate
from router.sim.trace import load_trace

TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "conversation_trace.jsonl"
if not TRACE.exists():  # a checkout without ../shared: its first 300 requests, kept in tests/data
    TRACE = Path(__file__).resolve().parents[1] / "data" / "conversation_trace_head300.jsonl"


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE, limit=300)


def test_cost_model_matches_dynamo_fit():
    assert CostModel().prefill_s(10_000) == pytest.approx((4.21e-7 * 1e8 + 152 + 16.5) / 1000)
    with pytest.raises(ValueError):
        CostModel(prefill_a=-1)


def test_same_inputs_give_identical_results(trace):
    cfg = SimConfig(policy="gcache", cache_blocks=2048)
    assert simulate(trace, cfg) == simulate(trace, cfg)


def test_cache_aware_policies_beat_round_robin_on_hit_rate(trace):
    rr = simulate(trace, SimConfig(policy="round_robin", cache_blocks=2048))
    gc = simulate(trace, SimConfig(policy="gcache", cache_blocks=2048))
    sg = simulate(trace, SimConfig(policy="sglang", cache_blocks=2048))
    assert gc["hit_rate"] > 1.25 * rr["hit_rate"]
    assert sg["hit_rate"] > rr["hit_rate"]
    assert gc["completed"] == rr["completed"] == 300 and gc["rejected"] == 0


def test_queue_orders_under_saturation(trace):
    def run(order, aging=2000.0):
        q = QueueConfig(order=order, aging_tokens_per_s=aging, max_wait_s=3600)
        return simulate(trace, SimConfig(policy="gcache", workers=4, max_inflight=4, speedup=4, queue=q))

    fcfs, unc = run(QueueOrder.FCFS), run(QueueOrder.UNCACHED)
    assert fcfs["max_wait_s"] > 10  # the queue is really used
    assert fcfs["max_wait_s"] <= unc["max_wait_s"]  # shortest-first makes someone wait longer...
    assert unc["mean_wait_s"] <= fcfs["mean_wait_s"]  # ...and everyone else wait less
    # with negligible aging the aged order is exactly shortest-first...
    slow = run(QueueOrder.AGED, aging=1e-3)
    assert {k: v for k, v in slow.items() if k != "queue"} == {k: v for k, v in unc.items() if k != "queue"}
    # ...and with fast aging it bounds the worst wait like FCFS does
    fast = run(QueueOrder.AGED, aging=1e6)
    assert fast["max_wait_s"] <= unc["max_wait_s"]


def test_cli_writes_json_table_and_png(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["sim", "--trace", str(TRACE), "--limit", "120", "--cache-blocks", "1024,2048",
               "--match-weights", "1,2", "--queues", "fcfs,aged", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    records = json.loads(out.read_text())
    # 2 caches x 2 queues x (3 policies + gcache x 2 weights)
    assert len(records) == 2 * 2 * 5
    for r in records:
        for k in ("policy", "queue", "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p90_long_s",
                  "throughput_tok_s", "max_wait_s"):
            assert k in r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round_robin" in capsys.readouterr().out
    assert main(["sim", "--trace", str(TRACE), "--policies", "nope"]) == 2
