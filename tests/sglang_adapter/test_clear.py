"""SGLang's storage clear (/hicache/storage-backend/clear -> HybridCacheController.clear_storage_backend
-> GCacheStorage.clear) through the real controller: no page of the namespace hits afterwards,
another namespace keeps its pages, and a clear that did not reach every daemon says so."""

from __future__ import annotations

import logging
import signal

import pytest

from tests.sglang_adapter.test_backend_v2 import PAGE, WINDOW_PAGES, _backup, _controller, _prefetch

pytestmark = pytest.mark.usefixtures("sgl")


def _hit_tokens(nodes, tokens, seed, extra=None):
    torch_ = __import__("torch")
    r = _controller(nodes, seed=seed, extra=extra)
    _op, hit, _acks = _prefetch(r, tokens, torch_.arange(64, 64 + 6 * PAGE),
                                torch_.arange(96, 96 + WINDOW_PAGES * PAGE))
    r.storage.close()
    return hit


def test_the_controllers_clear_leaves_no_hit_and_other_namespaces_alone(make_cluster):
    cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    torch_ = __import__("torch")
    tokens = list(range(3000, 3000 + 6 * PAGE))
    kv_idx, swa_idx = torch_.arange(0, 6 * PAGE), torch_.arange(40, 40 + WINDOW_PAGES * PAGE)
    w = _controller(cluster.addresses, seed=1)
    other = _controller(cluster.addresses, seed=2, extra={"namespace": "other-deployment"})
    _backup(w, tokens, [], kv_idx, swa_idx)
    _backup(other, tokens, [], kv_idx, swa_idx)
    assert _hit_tokens(cluster.addresses, tokens, 7) == 6 * PAGE

    w.ctl.enable_storage = True
    assert w.ctl.clear_storage_backend()  # SGLang's answer, whatever the backend did...
    assert _hit_tokens(cluster.addresses, tokens, 7) == 0  # ...and here it did delete them
    assert sum(s.get("ram_keys", 0) for s in w.storage.client.stats().values()) == 6 + WINDOW_PAGES  # other's
    assert _hit_tokens(cluster.addresses, tokens, 8, extra={"namespace": "other-deployment"}) == 6 * PAGE
    assert w.storage.clear()  # nothing left: still a complete clear


def test_a_clear_that_misses_a_daemon_returns_false_and_logs_it(make_cluster, caplog):
    cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    w = _controller(cluster.addresses, seed=1)
    cluster.kill(1, signal.SIGKILL)
    with caplog.at_level(logging.ERROR, logger="sglang_adapter.backend"):
        assert w.storage.clear() is False
    assert "NOT complete" in caplog.text and cluster.addresses[1] in caplog.text


def test_a_clear_with_a_stalled_daemon_holds_the_scheduler_briefly(make_cluster, caplog):
    """SGLang calls clear on its scheduler thread: with one daemon SIGSTOPped it held it for the
    client's 30 s clear timeout (a prober); now for at most CLEAR_WAIT_S."""
    import time

    from sglang_adapter.backend import CLEAR_WAIT_S

    cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    w = _controller(cluster.addresses, seed=2)
    cluster.kill(1, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="sglang_adapter.backend"):
            assert w.storage.clear() is False
        assert time.monotonic() - t0 < CLEAR_WAIT_S + 3
        assert "NOT complete" in caplog.text
    finally:
        cluster.kill(1, signal.SIGCONT)
