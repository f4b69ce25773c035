"""The admission core without a daemon: which connection is shed, the metadata budget, and the
rate-limited log."""

import logging
import socket
import threading
import time

import pytest

from gcache import protocol as P
from gcache.errors import ConfigError
from gcache.ratelog import RateLimitedLog
from gcache.server.admission import Admission, AdmissionConfig, MetaBudget


@pytest.fixture
def pairs():
    made = []

    def pair():
        a, b = socket.socketpair()
        made.extend((a, b))
        return a, b

    yield pair
    for s in made:
        s.close()


def eof(sock):
    sock.settimeout(2)
    return sock.recv(1) == b""


def test_at_the_cap_the_least_valuable_connection_is_shed(pairs):
    adm = Admission(AdmissionConfig(max_connections=3), token_required=True)
    (s1, _p1), (s2, p2), (s3, p3) = pairs(), pairs(), pairs()
    c1, c2, c3 = adm.admit(s1), adm.admit(s2), adm.admit(s3)
    c1.authed = c1.served = True  # a pooled client that has done work
    c2.authed = True  # authenticated, never served: second in line
    # c3: not authenticated, the newest -- still the first to go
    s4, _ = pairs()
    c4 = adm.admit(s4)
    assert c4 is not None and c3.shed and not c2.shed and eof(p3)
    adm.release(c3)
    c4.authed = c4.active = True  # in the middle of a request: never shed
    s5, _ = pairs()
    assert adm.admit(s5) is not None and c2.shed and eof(p2)
    adm.release(c2)
    assert len(adm) == 3 and adm.shed_total == 2


def test_with_every_connection_busy_a_newcomer_is_told_so(pairs):
    adm = Admission(AdmissionConfig(max_connections=1), token_required=False)
    s1, _ = pairs()
    adm.admit(s1).active = True
    s2, p2 = pairs()
    assert adm.admit(s2) is None and adm.refused_total == 1
    hdr = p2.recv(P.HEADER_SIZE)
    _v, _op, flags, _rid, meta_len, _pl = P.unpack_header(hdr)
    meta = P.decode_meta(p2.recv(meta_len))
    assert flags & P.FLAG_ERROR and meta["code"] == P.ErrorCode.BUSY and "too many connections" in meta["msg"]
    assert eof(p2)


def test_the_cap_stays_below_the_descriptor_limit():
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    adm = Admission(AdmissionConfig(max_connections=10**9, fd_headroom=100), token_required=False)
    assert adm.cap == soft - 100
    with pytest.raises(ConfigError):
        AdmissionConfig(max_connections=0)


@pytest.mark.parametrize("field", ["handshake_timeout_s", "frame_timeout_s", "progress_timeout_s"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_timeouts_must_be_positive_finite_seconds(field, value):
    with pytest.raises(ConfigError, match="a finite number of seconds > 0"):
        AdmissionConfig(**{field: value})
    assert getattr(AdmissionConfig(**{field: 0.25}), field) == 0.25


def test_metadata_budget_waits_bounded_and_refuses_what_never_fits():
    b = MetaBudget(100)
    assert b.acquire(60, 0.1) and not b.acquire(60, 0.05)
    assert not b.acquire(101, 5)  # larger than the budget: refused at once
    threading.Timer(0.05, b.release, (60,)).start()
    t0 = time.monotonic()
    assert b.acquire(60, 5) and time.monotonic() - t0 < 4
    assert b.used == 60


def test_rate_limited_log_counts_what_it_left_out(caplog):
    logger = logging.getLogger("test.ratelog")
    rl = RateLimitedLog(logger, burst=3, window_s=10)
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        logged = [rl.warning("k", "refused %d", i, now=100.0 + i * 0.01) for i in range(10)]
        assert rl.warning("other", "another kind", now=100.2)  # kinds are limited separately
        assert rl.warning("k", "refused again", now=111.0)
    assert logged == [True] * 3 + [False] * 7
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["refused 0", "refused 1", "refused 2"] and lines[3] == "another kind"
    assert "7 more like this" in lines[4]
