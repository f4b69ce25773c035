"""``gcache bench scaling`` (gcache/bench/scaling.py): the curve's table and plot from records."""

from __future__ import annotations

from gcache.bench.records import Record
from gcache.bench.scaling import combine, curve_table, metric, name, plot_scaling, procs_of


def rec(system, op, size, threads, gbps, keys, transport="tcp", lat=(1.0,)):
    return Record(system, op, size, 16, threads, gbps, keys, 1.0, 2.0, 3.0, transport=transport,
                  latencies_ms=list(lat))


def test_names_procs_and_units():
    r = rec("redis", "get", 4096, 2, 0.1, 25_000.0, transport="tcp-2p")
    assert (name(r), procs_of(r), metric(r)) == ("redis/tcp-2p", 2, 25_000.0)  # small values: keys/s
    big = rec("gcache", "get", 1 << 20, 1, 2.5, 2400.0)
    assert (name(big), procs_of(big), metric(big)) == ("gcache", 1, 2.5)  # >= 64 KiB: GB/s
    assert metric(rec("gcache", "exists", 1 << 20, 1, 0.0, 90_000.0)) == 90_000.0


def test_processes_add_up_and_latencies_pool():
    c = combine([rec("redis", "put", 4096, 1, 0.1, 20_000.0, lat=(1.0, 3.0)),
                 rec("redis", "put", 4096, 1, 0.2, 30_000.0, lat=(2.0,))], "tcp-2p")
    assert (c.ops_per_s, round(c.gbps, 6), c.p50_ms, c.transport) == (50_000.0, 0.3, 2.0, "tcp-2p")


def test_curve_table_has_one_column_per_process_and_thread_count(tmp_path):
    rs = [rec("gcache", "get", 1 << 20, 1, 2.0, 1900.0), rec("gcache", "get", 1 << 20, 4, 3.0, 2900.0),
          rec("gcache", "get", 1 << 20, 1, 3.5, 3300.0, transport="tcp-2p"),
          rec("redis", "get", 1 << 20, 1, 1.5, 1400.0)]
    lines = curve_table(rs).splitlines()
    assert lines[0] == "| op | value | batch | system | unit | 1p x 1t | 1p x 4t | 2p x 1t |"
    assert "| get | 1.0MiB | 16 | gcache | GB/s | 2.00 | 3.00 | 3.50 |" in lines
    assert "| get | 1.0MiB | 16 | redis | GB/s | 1.50 |  |  |" in lines
    path = plot_scaling(rs, str(tmp_path))
    assert path is not None and (tmp_path / "scaling.png").stat().st_size > 1000


def test_a_tiny_run_measures_one_and_two_client_processes(make_cluster):
    import shutil

    from gcache.bench.scaling import run_scaling

    peers = ("redis",) if shutil.which("redis-server") else ()
    cluster = make_cluster(nodes=1, mem="32MiB", extra_args=["--no-pretouch"])
    said = []
    recs = run_scaling(cluster.addresses, 32 << 20, (4096,), (4,), (1,), (1, 2), ("get",), 0.05, peers,
                       say=said.append)
    want = {"gcache", "gcache/tcp-2p"} | ({"redis", "redis/tcp-2p"} if peers else set())
    assert {name(r) for r in recs} == want, said
    assert all(r.ops_per_s > 0 and r.latencies_ms for r in recs)
