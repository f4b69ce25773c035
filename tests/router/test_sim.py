"""The simulator on a 300-request slice of the conversation trace: determinism,
policy and queue-order properties, and the CLI's JSON/PNG output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcache.mooncake_trace import load_trace
from router.cli import main
from router.config import DEFAULT_MAX_INFLIGHT, QueueConfig, QueueOrder, WorkerSpec
from router.sim.costmodel import CostModel
from router.sim.engine import SimConfig, simulate
from router.sim.synthetic import hot_prefix

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
    cfg = SimConfig(policy="min_ttft", cache_blocks=2048)
    assert simulate(trace, cfg) == simulate(trace, cfg)


def test_cache_aware_policies_beat_round_robin_on_hit_rate(trace):
    rr = simulate(trace, SimConfig(policy="round_robin", cache_blocks=2048))
    mt = simulate(trace, SimConfig(policy="min_ttft", cache_blocks=2048))
    sg = simulate(trace, SimConfig(policy="sglang", cache_blocks=2048))
    assert mt["hit_rate"] > 1.25 * rr["hit_rate"]
    assert sg["hit_rate"] > rr["hit_rate"]
    assert mt["completed"] == rr["completed"] == 300 and mt["rejected"] == 0


def test_one_default_in_flight_cap_for_serve_and_sim():
    assert SimConfig().max_inflight == WorkerSpec("http://w").max_inflight == DEFAULT_MAX_INFLIGHT


@pytest.mark.parametrize("rate", [60, 150])
def test_hot_prefix_spreads_like_the_gated_policy(rate):
    """400 requests sharing a 5K-token system prompt on 4 workers: min_ttft replicates the
    prefix instead of piling every request onto its owner."""
    reqs = hot_prefix(n=400, rate_per_s=rate)
    mt = simulate(reqs, SimConfig(policy="min_ttft", workers=4))
    sg = simulate(reqs, SimConfig(policy="sglang", workers=4))
    assert len(mt["per_worker"]) >= 2 and max(mt["per_worker"].values()) < 300
    assert mt["ttft_p90_s"] <= 1.5 * sg["ttft_p90_s"]
    assert mt["hit_rate"] >= sg["hit_rate"] - 0.01
    assert mt["reasons"].get("spill", 0) >= 1


def test_queue_orders_under_saturation(trace):
    def run(order, aging=2000.0, max_wait=3600.0):
        q = QueueConfig(order=order, aging_tokens_per_s=aging, max_wait_s=max_wait)
        return simulate(trace, SimConfig(policy="min_ttft", workers=4, max_inflight=4, speedup=4, queue=q))

    fcfs, unc = run(QueueOrder.FCFS), run(QueueOrder.UNCACHED)
    assert fcfs["max_wait_s"] > 10  # the queue is really used
    assert fcfs["max_wait_s"] <= unc["max_wait_s"]  # shortest-first makes someone wait longer...
    assert unc["mean_wait_s"] <= fcfs["mean_wait_s"]  # ...and everyone else wait less
    # with negligible aging (and a max wait that caps no prompt's tokens: aging x max_wait / 2)
    # the aged order is exactly shortest-first...
    slow = run(QueueOrder.AGED, aging=1e-3, max_wait=1e9)
    assert {k: v for k, v in slow.items() if k != "queue"} == {k: v for k, v in unc.items() if k != "queue"}
    # ...and with fast aging it bounds the worst wait like FCFS does
    fast = run(QueueOrder.AGED, aging=1e6)
    assert fast["max_wait_s"] <= unc["max_wait_s"]


def test_cli_writes_json_table_and_png(tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["sim", "--trace", str(TRACE), "--limit", "120", "--cache-blocks", "1024,2048",
               "--queues", "fcfs,aged", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    records = json.loads(out.read_text())
    assert len(records) == 2 * 2 * 4  # caches x queues x policies
    assert {r["max_inflight"] for r in records} == {DEFAULT_MAX_INFLIGHT}  # serve's default
    for r in records:
        for k in ("policy", "queue", "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p90_long_s",
                  "throughput_tok_s", "max_wait_s"):
            assert k in r
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round_robin" in capsys.readouterr().out
    assert main(["sim", "--trace", str(TRACE), "--policies", "nope"]) == 2
