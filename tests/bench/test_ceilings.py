"""The throughput bench's ceilings move the bytes they claim to, and gcache's records are compared
with the ceiling of their own carrier."""

import pytest

from gcache.bench.records import Record
from gcache.bench.targets import Socket
from gcache.bench.throughput import attach_ratios


def test_socket_ceiling_moves_bytes():
    s = Socket(1 << 20)
    try:
        rec = s.measure("get", 64 << 10, 4, 1, 0.1)
    finally:
        s.close()
    assert rec.system == "socket" and rec.gbps > 0 and rec.ops_per_s > 0


def test_raw_ucx_ceiling_moves_bytes_both_ways():
    pytest.importorskip("ucxx", reason="ucxx is not importable (install the ucx extra: pip install -e '.[ucx]')")
    from gcache.bench.targets import UcxRaw

    u = UcxRaw(1 << 20)
    try:
        got = [u.measure(op, 64 << 10, 4, 1, 0.1) for op in ("get", "put")]
    finally:
        u.close()
    assert [(r.system, r.transport, r.op) for r in got] == [("ucx-raw", "ucx", "get"), ("ucx-raw", "ucx", "put")]
    assert all(r.gbps > 0 for r in got)


def _rec(system, transport, gbps):
    return Record(system=system, op="get", value_bytes=4096, batch=16, threads=1, gbps=gbps, ops_per_s=gbps * 1e5,
                  p50_ms=1.0, p99_ms=1.0, p999_ms=1.0, transport=transport)


def test_each_carrier_is_divided_by_its_own_ceiling():
    out = {(r.system, r.transport): r for r in attach_ratios([
        _rec("socket", "tcp", 2.0), _rec("ucx-raw", "ucx", 4.0), _rec("memcpy", "local", 10.0),
        _rec("gcache", "tcp", 1.0), _rec("gcache", "ucx", 1.0), _rec("gcache", "local", 5.0)])}
    assert out[("gcache", "tcp")].ratio == 0.5
    assert out[("gcache", "ucx")].ratio == 0.25
    assert out[("gcache", "local")].ratio == 0.5
    assert "ucx-raw" not in out[("gcache", "tcp")].ratios  # ceilings are not peers
