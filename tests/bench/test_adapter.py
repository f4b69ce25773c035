"""``gcache bench adapter`` (gcache/bench/adapter.py): the SGLang adapter's batch_set_v1 /
batch_get_v1 beside the raw client, its pure figures, its --help, and a tiny real run."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from gcache.bench.adapter import AdapterBenchConfig, Calls, format_markdown, geometry, make_record
from gcache.cli import build_parser

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None


def test_geometry_makes_pages_of_the_asked_size():
    assert geometry(1 << 20) == (8, 128)  # K + V x 4 layers x 64 bf16 tokens x 8 heads x 128
    assert geometry(64 << 10) == (1, 64)
    with pytest.raises(ValueError):
        geometry(1000)
    with pytest.raises(ValueError):
        AdapterBenchConfig(ops=("delete",))


def test_record_divides_adapter_by_raw_over_summed_call_times():
    cfg = AdapterBenchConfig(pages=64, page_bytes=1 << 20)
    moved = 64 << 20
    rec = make_record("get", "tcp", cfg, Calls([0.02, 0.02, 0.08], [0.004, 0.005, 0.006]),
                      Calls([0.02, 0.02, 0.02], [0.004, 0.004, 0.004]), own_us=150.0)
    assert rec.adapter_gbps == pytest.approx(3 * moved / 0.12 / 1e9)
    assert rec.raw_gbps == pytest.approx(3 * moved / 0.06 / 1e9)
    assert rec.ratio == pytest.approx(0.5)
    assert rec.ratio_p50 == pytest.approx(1.0)  # same median call
    assert (rec.adapter_calls, rec.raw_calls) == (3, 3)
    assert (rec.adapter_cpu_ms, rec.raw_cpu_ms) == pytest.approx((5.0, 4.0))
    row = format_markdown([rec]).splitlines()[2]
    assert row.startswith("| tcp | batch_get_v1 / get_into | 64 x 1.0MiB |") and "| 0.500 |" in row


def test_help_lists_the_options(capsys):
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    with pytest.raises(SystemExit) as exc:
        sub.choices["bench"].parse_args(["adapter", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    assert all(opt in out for opt in ("--pages", "--page-bytes", "--seconds", "--transport", "--json"))


@pytest.mark.skipif(not HAVE_SGLANG, reason="sglang 0.5.23 / torch not installed: make sglang-deps")
def test_tiny_run_gives_both_figures_over_both_paths(make_cluster):
    from gcache.bench.adapter import measure

    cluster = make_cluster(nodes=1, mem="32MiB", extra_args=["--no-pretouch"])
    cfg = AdapterBenchConfig(pages=4, page_bytes=64 << 10, seconds=0.1)
    recs = measure(cluster.addresses, cfg, progress=False)  # raises if a get returned other bytes
    assert {(r.transport, r.op) for r in recs} == {(t, o) for t in ("tcp", "local") for o in ("set", "get")}
    assert all(r.adapter_gbps > 0 and r.raw_gbps > 0 and r.ratio > 0 and r.adapter_calls > 0 for r in recs)
