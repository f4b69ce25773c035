"""The adapter against the real sglang 0.5.23 classes and real gcache daemons: v1 (zero-copy KV)."""

from __future__ import annotations

import ctypes
import signal
import threading
import time

import pytest

from tests.sglang_adapter.conftest import POOL_ARGS, fill_random, make_storage, mha_host_pool

pytestmark = pytest.mark.usefixtures("sgl")


def page_bytes_at(pool, idx):
    ptrs, sizes = pool.get_page_buffer_meta(idx)
    return [ctypes.string_at(p, n) for p, n in zip(ptrs, sizes)]


def test_created_through_the_factory_dynamic_mechanism(adapter_cluster):
    from sglang_adapter.backend import GCacheStorage

    s = make_storage(adapter_cluster.addresses)
    assert isinstance(s, GCacheStorage) and s.config.nodes == tuple(adapter_cluster.addresses)
    s.close()


def test_bootstraps_from_the_masters_with_the_cluster_token_file(tmp_path, monkeypatch):
    """The adapter takes gcache://masters like the client, and the token from a token file."""
    import torch

    from gcache.cluster import LocalCluster

    for k in ("GCACHE_TOKEN", "GCACHE_TOKEN_FILE", "GCACHE_MASTERS", "GCACHE_NODES"):
        monkeypatch.delenv(k, raising=False)
    c = LocalCluster(nodes=2, mem="32MiB", masters=1, root=str(tmp_path), extra_args=POOL_ARGS).start()
    try:
        src, dst = mha_host_pool(), mha_host_pool()
        fill_random(src, seed=3)
        w = make_storage([], {"nodes": c.master_url, "token_file": c.token_file})
        monkeypatch.setenv("GCACHE_TOKEN_FILE", c.token_file)  # the same resolution through the environment
        r = make_storage([], {"nodes": c.master_url})
        assert sorted(w.client.membership.owners()) == ["node0", "node1"]
        w.register_mem_pool_host(src)
        r.register_mem_pool_host(dst)
        keys = [f"masters-{i}" for i in range(5)]
        idx = torch.arange(8, 28)
        assert w.batch_set_v1(keys, idx) == [True] * 5
        assert r.batch_get_v1(keys, idx) == [True] * 5
        assert page_bytes_at(dst, idx) == page_bytes_at(src, idx)
        w.close()
        r.close()
    finally:
        c.stop()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_v1_round_trip_through_real_host_pools(adapter_cluster, layout):
    import torch

    src, dst = mha_host_pool(layout), mha_host_pool(layout)
    fill_random(src, seed=1)
    w, r = make_storage(adapter_cluster.addresses), make_storage(adapter_cluster.addresses)
    w.register_mem_pool_host(src)
    r.register_mem_pool_host(dst)
    keys = [f"{layout}-{i:02x}" for i in range(5)]
    idx = torch.arange(8, 28)  # 5 pages of 4 tokens
    assert w.batch_set_v1(keys, idx) == [True] * 5
    assert r.batch_exists(keys) == 5 and r.batch_exists(keys + ["absent"]) == 5
    assert page_bytes_at(dst, idx) != page_bytes_at(src, idx)
    assert r.batch_get_v1(keys, idx) == [True] * 5
    assert page_bytes_at(dst, idx) == page_bytes_at(src, idx)
    assert r.batch_get_v1(["absent"] + keys[:1], idx[:8]) == [False, True]
    m = w.get_stats()
    assert m.backup_pgs == [5] and m.backup_bandwidth[0] > 0 and w.get_stats().backup_pgs == []
    assert r.get_stats().prefetch_pgs == [5, 1]
    w.close()
    r.close()


def test_asymmetric_kv_pool_needs_and_gets_the_zero_copy_path(adapter_cluster):
    import torch
    from sglang.srt.mem_cache.pool_host.mha import AsymmetricMHATokenToKVPoolHost

    src, dst = mha_host_pool("page_first", head_dim=8, v_head_dim=4), mha_host_pool("page_first", head_dim=8,
                                                                                     v_head_dim=4)
    assert isinstance(src, AsymmetricMHATokenToKVPoolHost)
    with pytest.raises(NotImplementedError):
        src.get_data_page(0, flat=True)  # the flat page API SGLang's generic path would use
    fill_random(src, seed=2)
    s = make_storage(adapter_cluster.addresses)
    s.register_mem_pool_host(src)
    idx = torch.arange(4, 16)
    assert s.batch_set_v1(["a0", "a1", "a2"], idx) == [True] * 3
    s.register_mem_pool_host(dst)
    assert s.batch_get_v1(["a0", "a1", "a2"], idx) == [True] * 3
    assert page_bytes_at(dst, idx) == page_bytes_at(src, idx)


def test_concurrent_callers(adapter_cluster):
    import torch

    src = mha_host_pool("page_first", tokens=256)
    fill_random(src, seed=3)
    s = make_storage(adapter_cluster.addresses)
    s.register_mem_pool_host(src)
    errors = []

    def worker(t):
        try:
            for rnd in range(5):
                keys = [f"t{t}-{rnd}-{i}" for i in range(4)]
                idx = torch.arange(t * 64, t * 64 + 16)
                assert s.batch_set_v1(keys, idx) == [True] * 4
                assert s.batch_get_v1(keys, idx) == [True] * 4
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread below)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


def test_dead_daemon_means_misses_not_exceptions_or_hangs(make_cluster):
    import torch

    adapter_cluster = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    src = mha_host_pool("page_first", tokens=128)
    fill_random(src, seed=4)
    s = make_storage(adapter_cluster.addresses, extra={"timeout_s": 0.5})
    s.register_mem_pool_host(src)
    keys = [f"d{i}" for i in range(16)]
    idx = torch.arange(0, 64)
    assert s.batch_set_v1(keys, idx) == [True] * 16
    owners = s.client.owners(s.page_keys(keys, "kv"))
    assert len(set(owners)) == 2
    dead = {adapter_cluster.daemons[0].node_id, adapter_cluster.daemons[0].address}
    adapter_cluster.kill(0)
    t0 = time.monotonic()
    got = s.batch_get_v1(keys, idx)
    assert got == [o not in dead for o in owners]
    assert s.batch_exists(keys) == next(i for i, o in enumerate(owners) if o in dead)
    res = s.batch_set_v1([k + "x" for k in keys], idx)
    assert not all(res) and any(res)
    assert time.monotonic() - t0 < 5.0
    s.close()


# -- self-describing pages: a page is only ever read back in the format it was written in -----------
@pytest.mark.parametrize("writer,reader", [("page_first", "layer_first"), ("page_first", "page_first_direct"),
                                           ("page_first_direct", "layer_first")])
def test_a_page_written_in_one_layout_is_a_miss_in_another(adapter_cluster, writer, reader):
    import torch

    src, dst = mha_host_pool(writer), mha_host_pool(reader)
    fill_random(src, seed=11)
    w, r = make_storage(adapter_cluster.addresses), make_storage(adapter_cluster.addresses)
    w.register_mem_pool_host(src)
    r.register_mem_pool_host(dst)
    keys = [f"lay-{writer}-{reader}-{i}" for i in range(3)]
    idx = torch.arange(4, 16)
    before = page_bytes_at(dst, idx)
    assert w.batch_set_v1(keys, idx) == [True] * 3
    assert r.batch_exists(keys) == 0
    assert r.batch_get_v1(keys, idx) == [False] * 3
    assert page_bytes_at(dst, idx) == before  # nothing was written into the reader's pool
    assert w.batch_exists(keys) == 3  # the writer's own format still hits
    w.close()
    r.close()


def test_dtype_and_page_size_are_part_of_a_pages_identity(adapter_cluster):
    import torch

    bf16, fp32 = mha_host_pool(dtype=torch.bfloat16), mha_host_pool(dtype=torch.float32)
    fill_random(bf16, seed=12)
    fill_random(fp32, seed=13)
    a, b = make_storage(adapter_cluster.addresses), make_storage(adapter_cluster.addresses)
    a.register_mem_pool_host(bf16)
    b.register_mem_pool_host(fp32)
    keys = [f"dt-{i}" for i in range(3)]
    idx = torch.arange(0, 12)
    assert a.batch_set_v1(keys, idx) == [True] * 3
    assert b.batch_exists(keys) == 0  # the bf16 pages are not fp32 pages
    assert b.batch_set_v1(keys, idx) == [True] * 3  # really stored, not skipped as "existing"
    assert b.batch_exists(keys) == 3
    out = mha_host_pool(dtype=torch.float32)
    c = make_storage(adapter_cluster.addresses)
    c.register_mem_pool_host(out)
    assert c.batch_get_v1(keys, idx) == [True] * 3
    assert page_bytes_at(out, idx) == page_bytes_at(fp32, idx)
    other_page = make_storage(adapter_cluster.addresses)
    other_page.register_mem_pool_host(mha_host_pool(page=8))
    assert other_page.batch_exists(keys) == 0
    for s in (a, b, c, other_page):
        s.close()


def test_legacy_tensor_path_keys_carry_dtype_and_shape(adapter_cluster):
    import torch

    s = make_storage(adapter_cluster.addresses)
    val = torch.rand(4, 8, dtype=torch.float32)
    assert s.batch_set(["leg-0"], [val]) is True
    same = torch.zeros(4, 8, dtype=torch.float32)
    assert s.batch_get(["leg-0"], [same])[0] is same and torch.equal(same, val)
    half = torch.zeros(8, 8, dtype=torch.bfloat16)  # same byte size, other dtype and shape
    assert s.batch_get(["leg-0"], [half]) == [None] and not half.any()
    m = s.get_stats()  # the legacy path records its pages too (it recorded none: a prober)
    assert m.backup_pgs == [1] and m.prefetch_pgs == [1] and m.backup_bandwidth[0] > 0
    s.close()


def test_a_legacy_get_of_a_value_of_another_size_is_a_miss_not_a_partly_filled_tensor(adapter_cluster):
    """Found by a probe: the legacy batch_get took any stored value under the key for a hit, so a
    shorter one (another writer in the namespace) left the tensor's tail as it was and SGLang
    would have used it as KV. The zero-copy path already compared sizes."""
    import torch

    s = make_storage(adapter_cluster.addresses)
    val = torch.rand(4, 8, dtype=torch.float32)
    assert s.batch_set(["leg-short"], [val]) is True
    key = s._tensor_key("leg-short", val)
    for size in (val.numel() * 4 - 64, 0):  # another writer, in the adapter's namespace and pool
        assert s.client.put([key], [bytes(size)], pool="kv")[0].name == "OK"
        out = torch.full((4, 8), -7.0)
        assert s.batch_get(["leg-short"], [out]) == [None]
    s.close()


def test_a_model_name_longer_than_a_key_still_stores_pages_and_too_long_hashes_are_said(adapter_cluster, caplog):
    """Found by a probe: a ~1,000-character served name, or page hashes that long, made every
    page key too long: every page silently failed."""
    import logging

    import torch

    src = mha_host_pool()
    fill_random(src, seed=11)
    idx = torch.arange(0, 16)
    s = make_storage(adapter_cluster.addresses, model_name="org/" + "m" * 1500)
    try:
        s.register_mem_pool_host(src)
        assert s.batch_set_v1(["long-a", "long-b", "long-c", "long-d"], idx) == [True] * 4
        assert s.batch_exists(["long-a", "long-b", "long-c", "long-d"]) == 4
        caplog.set_level(logging.WARNING, logger="sglang_adapter.backend")
        huge = ["h" * 2000 + str(i) for i in range(4)]
        assert s.batch_set_v1(huge, idx) == [False] * 4
        assert s.batch_get_v1(huge, idx) == [False] * 4
    finally:
        s.close()
    lines = [r.getMessage() for r in caplog.records if "exceed" in r.getMessage()]
    assert len(lines) == 1 and "never stored or found" in lines[0], lines


def test_a_refused_token_is_logged_once_not_silent(make_cluster, tmp_path, monkeypatch, caplog):
    """With OnNodeError.MISS a daemon refusing the token made every page a miss and said nothing:
    SGLang ran on without its L3 and nothing told the operator why."""
    import logging

    import torch

    for var in ("GCACHE_TOKEN", "GCACHE_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    c = make_cluster(nodes=1, mem="32MiB", extra_args=[*POOL_ARGS, "--token-file", str(token)])
    src = mha_host_pool()
    fill_random(src, seed=5)
    idx = torch.arange(0, 16)
    caplog.set_level(logging.WARNING, logger="sglang_adapter.backend")
    s = make_storage(c.addresses)  # no token
    try:
        s.register_mem_pool_host(src)
        assert s.batch_set_v1(["a", "b", "c", "d"], idx) == [False] * 4
        assert s.batch_get_v1(["a", "b", "c", "d"], idx) == [False] * 4
        assert s.batch_exists(["a", "b"]) == 0
    finally:
        s.close()
    lines = [r.getMessage() for r in caplog.records if "token" in r.getMessage()]
    assert len(lines) == 1 and "token_file" in lines[0] and "GCACHE_TOKEN_FILE" in lines[0], lines
    good = make_storage(c.addresses, {"token_file": str(token)})
    try:
        good.register_mem_pool_host(src)
        assert good.batch_set_v1(["a", "b", "c", "d"], idx) == [True] * 4
    finally:
        good.close()


def test_a_backup_against_a_hung_daemon_ends_within_timeout_s(make_cluster):
    """Found by a probe: with skip_existing a backup asks which pages exist, then puts the rest,
    each call with its own timeout_s, so a hung (SIGSTOPped) daemon cost a backup twice
    timeout_s. Both rounds share one deadline now; the other daemon's pages are still stored."""
    import torch

    from tests.conftest import sigstop

    c = make_cluster(nodes=2, mem="32MiB", extra_args=["--no-pretouch"])
    src = mha_host_pool("page_first", tokens=128)
    fill_random(src, seed=5)
    s = make_storage(c.addresses, extra={"timeout_s": 1.0, "local": "off"})
    s.register_mem_pool_host(src)
    keys = [f"hung{i}" for i in range(16)]
    idx = torch.arange(0, 64)
    owners = s.client.owners(s.page_keys(keys, "kv"))
    hung = {c.daemons[0].node_id, c.daemons[0].address}
    assert 0 < sum(o in hung for o in owners) < len(keys)
    sigstop(c.daemons[0].pid)
    try:
        t0 = time.monotonic()
        res = s.batch_set_v1(keys, idx)
        took = time.monotonic() - t0
    finally:
        c.daemons[0].proc.send_signal(signal.SIGCONT)
    assert took < 1.5, f"a backup took {took:.2f}s with timeout_s=1.0"
    assert res == [o not in hung for o in owners]  # the healthy daemon's pages are stored
    s.close()
    # the daemon stopped and continued still stops on SIGTERM: it ignored it (3 runs in 4) while
    # its main thread waited in Event.wait() and the kernel gave the signal to another thread
    from tests.conftest import poll

    c.daemons[0].proc.send_signal(signal.SIGTERM)
    assert poll(lambda: c.daemons[0].proc.poll() is not None, 5), "SIGTERM ignored"
