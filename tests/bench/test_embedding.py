"""``gcache bench embedding`` (gcache/bench/embedding.py), a short version on one real daemon:
the SGLang embedding store and the raw client move the same bytes, exactly, both ways."""

from __future__ import annotations

import importlib.util

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None
pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang 0.5.23 / torch not installed: make sglang-deps")

EMB_ARGS = ["--no-pretouch", "--pool-budget", "emb=24MiB"]


def test_bench_short_version_moves_exact_bytes_both_ways(make_cluster):
    from gcache.bench.embedding import EmbeddingBenchConfig, format_markdown, measure

    cluster = make_cluster(nodes=1, mem="48MiB", extra_args=EMB_ARGS)
    cfg = EmbeddingBenchConfig(tokens=(64,), hidden=512, batch=2, runs=2, seconds=0.1)
    recs = measure(cluster.addresses, cfg, progress=False)  # raises if a get returned other bytes
    assert {(r.transport, r.op) for r in recs} == {("local", "get"), ("local", "put"), ("tcp", "get"),
                                                   ("tcp", "put")}
    assert all(r.store_calls > 0 and r.raw_calls > 0 and r.ratio > 0 for r in recs)
    assert "| local | get | 64 x 512 bf16" in format_markdown(recs)
