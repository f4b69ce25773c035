"""Result records, ratios and the JSON schema check."""

import json

import pytest

from gcache.bench.records import Record, from_latencies, validate, write_json
from gcache.bench.throughput import Profile, attach_ratios, format_markdown, format_table


def rec(system, op="get", gbps=1.0, transport="tcp", ops=100.0):
    return Record(system, op, 1 << 20, 16, 1, gbps, ops, 1.0, 2.0, 3.0, transport=transport)


def test_from_latencies_counts_keys_and_bytes():
    r = from_latencies("gcache", "put", 1000, 4, 1, elapsed_s=2.0, batches_done=10, lat_s=[0.001] * 10)
    assert r.ops_per_s == 20.0 and r.gbps == pytest.approx(40 * 1000 / 2 / 1e9)
    assert r.p50_ms == pytest.approx(1.0) and r.p999_ms == pytest.approx(1.0)
    ex = from_latencies("redis", "exists", 1000, 4, 1, 1.0, 5, [0.002, 0.004])
    assert ex.gbps == 0.0 and ex.p99_ms > ex.p50_ms


def test_ratios_to_ceiling_and_peers():
    recs = attach_ratios([rec("socket", gbps=4.0), rec("memcpy", gbps=20.0), rec("gcache", gbps=3.0),
                          rec("redis", gbps=2.0), rec("mooncake", gbps=1.5),
                          rec("gcache", op="exists", gbps=0.0, ops=900.0), rec("redis", op="exists", gbps=0.0, ops=300.0)])
    by = {(r.system, r.op): r for r in recs}
    g = by[("gcache", "get")]
    assert (g.ceiling_gbps, g.ratio) == (4.0, 0.75)
    assert g.ratios == {"redis": 1.5, "mooncake": 2.0}
    assert by[("redis", "get")].ratios == {"gcache": pytest.approx(2 / 3, abs=1e-4), "mooncake": pytest.approx(4 / 3, abs=1e-4)}
    assert by[("socket", "get")].ratios == {}  # a ceiling is not compared with the systems
    assert by[("gcache", "exists")].ratios == {"redis": 3.0}  # keys/s when no bytes move
    table = format_table(recs)
    assert "vs redis" in table and "1.50" in table and "2.00" in table
    assert format_markdown(recs).count("\n") == len(recs) + 2


def test_local_transport_is_compared_with_memcpy():
    recs = attach_ratios([rec("socket", gbps=4.0), rec("memcpy", gbps=20.0, transport="local"),
                          rec("gcache", gbps=10.0, transport="local"), rec("redis", gbps=2.0)])
    local = next(r for r in recs if r.system == "gcache")
    assert (local.ceiling_gbps, local.ratio, local.ratios) == (20.0, 0.5, {"redis": 5.0})


def test_profile_rejects_nonsense():
    with pytest.raises(ValueError, match="unknown ops"):
        Profile(sizes=(4096,), ops=("scan",))
    with pytest.raises(ValueError):
        Profile(sizes=(4096,), threads=(0,))
    assert len(Profile(sizes=(1, 2), batches=(1, 16), threads=(1,), ops=("put", "get")).configs()) == 8


def test_written_documents_validate(tmp_path):
    p = tmp_path / "r" / "t.json"
    write_json(str(p), "throughput", [r.to_json() for r in attach_ratios([rec("socket"), rec("gcache")])])
    doc = json.loads(p.read_text())
    assert validate(doc) == [] and doc["machine"]["cpus"] >= 1 and "numpy" in doc["machine"]["versions"]
    assert "latencies_ms" not in doc["records"][0]
    del doc["records"][1]["p999_ms"]
    doc["records"][0]["system"] = "memcached"
    problems = validate(doc)
    assert any("unknown system" in x for x in problems) and any("p999_ms" in x for x in problems)
    bad = {"kind": "hitrate", "machine": {"cpus": 1}, "records": [
        {"capacity_bytes": 1, "disk_bytes": 0, "nodes": 1, "page_bytes": 8, "requests": 1, "hit_rate": 0.5,
         "trace_max_hit_rate": 0.4, "ratio_to_max": 1.25, "series": []}]}
    assert any("outside" in x for x in validate(bad))


def test_write_report_writes_the_json_and_the_table_beside_it(tmp_path, capsys):
    from gcache.bench.records import write_report

    md = write_report(str(tmp_path / "x" / "run.json"), "adapter", [{"a": 1}], "| a |\n|---|\n| 1 |\n", nodes="2")
    doc = json.loads((tmp_path / "x" / "run.json").read_text())
    assert doc["kind"] == "adapter" and doc["records"] == [{"a": 1}] and doc["nodes"] == "2"
    assert md.endswith("run.md") and (tmp_path / "x" / "run.md").read_text().startswith("| a |")
    assert "wrote" in capsys.readouterr().out


def test_cluster_for_a_running_cluster_starts_nothing():
    from gcache.bench.driver import cluster_for

    with cluster_for("127.0.0.1:1,127.0.0.1:2", 1 << 30) as addresses:
        assert addresses == ["127.0.0.1:1", "127.0.0.1:2"]
