"""gcache as SGLang's multimodal global embedding store, driven by the real EmbeddingCacheController.

The controller is sglang 0.5.23's own (constructed on CPU by emb_shim: single-rank parallel state,
unpinned pools; staging stands in for the GPU→host copy). The daemons are real processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import poll
from tests.sglang_adapter.conftest import HAVE_SGLANG

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang 0.5.23 / torch not installed: make sglang-deps")

HIDDEN, TOKENS = 1024, 300  # bf16: 128 tokens a 256 KiB page, 3 pages (600 KiB) an embedding
EMB_ARGS = ["--no-pretouch", "--pool-budget", "emb=24MiB"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def wait_prefetch(ctrl, req_id, timeout=30.0):
    assert poll(lambda: ctrl.check_prefetch_progress(req_id), timeout, every=0.005), \
        f"prefetch {req_id} not finished within {timeout}s"


@pytest.fixture
def emb(sgl, make_cluster):
    """(cluster, make): make(**store_config, hidden=, dtype=, pool_mib=) -> (store, controller);
    all are stopped at teardown."""
    import torch

    from sglang_adapter.embedding import GCacheEmbeddingStore
    from tests.sglang_adapter import emb_shim as S

    cluster = make_cluster(nodes=1, mem="48MiB", extra_args=[*EMB_ARGS, "--metrics-port", "0"])
    made = []

    def make(hidden=HIDDEN, dtype=torch.bfloat16, pool_mib=4, **cfg):
        store = GCacheEmbeddingStore({"nodes": cluster.addresses, "model": "test/vlm", "timeout_s": 10.0, **cfg})
        ctrl = S.controller(store, hidden=hidden, dtype=dtype, pool_mib=pool_mib)
        made.append((store, ctrl))
        return store, ctrl

    yield cluster, make
    for store, ctrl in made:
        S.stop(ctrl)
        store.close()


def test_insert_evict_locally_then_prefetch_from_gcache(emb):
    from sglang.srt.managers.schedule_batch import Modality

    from tests.sglang_adapter import emb_shim as S

    _, make = emb
    store, ctrl = make()
    assert repr(store).endswith("pools=['vision:bfloat16x1024', 'audio:bfloat16x1024'])")
    embs = {f"img{i}": S.embedding(i, TOKENS, HIDDEN) for i in range(8)}
    names = list(embs)
    # the vision pool holds 12 pages = 4 embeddings: stage and insert two rounds of 4
    for batch in (names[:4], names[4:]):
        assert S.stage(ctrl, batch, [embs[h] for h in batch]) == batch
        ctrl.insert_batch(batch, Modality.IMAGE)
        ctrl.insert_queue.join()
    m = store.metrics()
    assert (m["puts"], m["put_stored"], m["put_bytes"]) == (8, 8, 8 * TOKENS * HIDDEN * 2)
    # the first four were evicted from the controller's own pool to make room for the rest
    assert not any(ctrl.has_local_embedding(h) for h in names[:4])
    assert ctrl.get_stats()["eviction_count"] >= 1
    assert asyncio.run(ctrl.batch_is_exist([*names[:2], "never-seen"])) == [True, True, False]

    ctrl.prefetch("r1", names[:2], [TOKENS, TOKENS], Modality.IMAGE)
    wait_prefetch(ctrl, "r1")
    for h in names[:2]:
        assert ctrl.has_local_embedding(h)
        assert S.pool_bytes(ctrl, h).equal(embs[h]), f"{h}: pool holds other bytes than were inserted"
    m = store.metrics()
    assert (m["gets"], m["get_hits"], m["errors"], m["unregistered"]) == (2, 2, 0, 0)

    # inserting what gcache already holds sends nothing (content-addressed keys)
    ctrl.insert_batch(names[:2], Modality.IMAGE)
    ctrl.insert_queue.join()
    assert store.metrics()["put_skipped"] == 2 and store.metrics()["put_stored"] == 8


def test_a_reader_expecting_another_token_count_misses(emb):
    from sglang.srt.managers.schedule_batch import Modality

    from tests.sglang_adapter import emb_shim as S

    _, make = emb
    _, ctrl = make()
    e = S.embedding(7, TOKENS, HIDDEN)
    S.stage(ctrl, ["x"], [e])
    ctrl.insert_batch(["x"], Modality.IMAGE)
    ctrl.insert_queue.join()
    _, reader = make()
    for tokens in (TOKENS - 1, TOKENS + 1):  # value smaller / larger than the reader's buffers
        reader.prefetch(f"t{tokens}", ["x"], [tokens], Modality.IMAGE)
        wait_prefetch(reader, f"t{tokens}")
        assert not reader.has_local_embedding("x")
    reader.prefetch("ok", ["x"], [TOKENS], Modality.IMAGE)
    wait_prefetch(reader, "ok")
    assert S.pool_bytes(reader, "x").equal(e)


def test_two_controllers_in_two_processes_share_through_local_shared_memory(emb):
    from sglang.srt.managers.schedule_batch import Modality

    from gcache.server.metrics import scrape
    from tests.sglang_adapter import emb_shim as S

    cluster, make = emb
    n = 3
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    peer = subprocess.Popen([sys.executable, "-m", "tests.sglang_adapter.emb_peer", cluster.addresses[0], str(n),
                             str(TOKENS), str(HIDDEN)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    store, ctrl = make()  # built while the peer starts
    (stats,) = store.client.stats().values()
    metrics_at = stats["metrics_address"]
    before = scrape(metrics_at)
    try:
        out, err = peer.communicate(timeout=90)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
    assert peer.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    hashes = [f"peer-{i}" for i in range(n)]
    assert report["staged"] == hashes and report["put_stored"] == n

    assert asyncio.run(ctrl.batch_is_exist(hashes)) == [True] * n
    ctrl.prefetch("from-peer", hashes, [TOKENS] * n, Modality.IMAGE)
    wait_prefetch(ctrl, "from-peer")
    for i, h in enumerate(hashes):
        assert S.pool_bytes(ctrl, h).equal(S.embedding(1000 + i, TOKENS, HIDDEN))

    # the daemon counted the gets and puts of both processes, and no payload byte crossed TCP:
    # they went through its shared-memory arena
    after = scrape(metrics_at)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta['gcache_request_keys_total{op="put"}'] >= n
    assert delta['gcache_request_keys_total{op="get"}'] >= n
    assert delta.get('gcache_bytes_total{direction="in",path="tcp"}', 0) == 0
    assert delta.get('gcache_bytes_total{direction="out",path="tcp"}', 0) == 0
    assert delta.get('gcache_bytes_total{direction="out",path="local"}', 0) >= n * TOKENS * HIDDEN * 2
    # the same get with the local path off does move the bytes over TCP (the metric can tell)
    _, tcp_ctrl = make(local="off")
    tcp_ctrl.prefetch("tcp", hashes[:1], [TOKENS], Modality.IMAGE)
    wait_prefetch(tcp_ctrl, "tcp")
    assert tcp_ctrl.has_local_embedding(hashes[0])
    out_bytes = scrape(metrics_at).get('gcache_bytes_total{direction="out",path="tcp"}', 0) - after.get(
        'gcache_bytes_total{direction="out",path="tcp"}', 0)
    assert out_bytes == TOKENS * HIDDEN * 2


def test_killed_daemon_is_a_miss_never_an_exception(emb):
    from sglang.srt.managers.schedule_batch import Modality

    from tests.sglang_adapter import emb_shim as S

    cluster, make = emb
    store, ctrl = make(timeout_s=0.5)
    S.stage(ctrl, ["a", "b"], [S.embedding(1, TOKENS, HIDDEN), S.embedding(2, TOKENS, HIDDEN)])
    ctrl.insert_batch(["a"], Modality.IMAGE)
    ctrl.insert_queue.join()
    assert store.metrics()["put_stored"] == 1
    cluster.kill(0)

    t0 = time.monotonic()
    ctrl.insert_batch(["b"], Modality.IMAGE)
    ctrl.insert_queue.join()
    assert ctrl.has_local_embedding("b")  # a failed PUT keeps the local entry
    assert store.batch_is_exist(["a", "gone"]) == [False, False]  # stored before the kill: now a miss
    _, reader = make(timeout_s=0.5)
    assert asyncio.run(reader.batch_is_exist(["a"])) == [False]
    reader.prefetch("r", ["a"], [TOKENS], Modality.IMAGE)
    wait_prefetch(reader, "r")
    assert not reader.has_local_embedding("a")
    assert time.monotonic() - t0 < 8.0
    m = store.metrics()
    assert m["put_stored"] == 1 and m["exist_hits"] == 0
    assert ctrl.io_thread.is_alive() and reader.io_thread.is_alive()
    # direct calls answer misses too
    assert store.batch_get_into_multi_buffers(["a"], [[0]], [[1]]) == [False]


def test_another_dtype_hidden_size_or_model_is_a_miss(emb):
    import torch
    from sglang.srt.managers.schedule_batch import Modality

    from tests.sglang_adapter import emb_shim as S

    _, make = emb
    store, writer = make()
    e = S.embedding(5, TOKENS, HIDDEN)
    S.stage(writer, ["img"], [e])
    writer.insert_batch(["img"], Modality.IMAGE)
    writer.insert_queue.join()
    assert store.metrics()["put_stored"] == 1

    readers = {
        "fp32": make(dtype=torch.float32, pool_mib=8)[1],
        "hidden 512": make(hidden=512)[1],
        "other model": make(model="test/other-vlm")[1],
    }
    for why, reader in readers.items():
        assert asyncio.run(reader.batch_is_exist(["img"])) == [False], why
        reader.prefetch(why, ["img"], [TOKENS], Modality.IMAGE)
        wait_prefetch(reader, why)
        assert not reader.has_local_embedding("img"), why
    _, same = make()  # the positive control: same model, dtype and hidden size
    assert asyncio.run(same.batch_is_exist(["img"])) == [True]
    same.prefetch("same", ["img"], [TOKENS], Modality.IMAGE)
    wait_prefetch(same, "same")
    assert S.pool_bytes(same, "img").equal(e)


def _direct_store(sgl_cluster_addresses, rows=8, hidden=16, **cfg):
    """A store with one registered bf16 pool of ``rows`` x ``hidden``, called directly (no controller)."""
    import torch

    from sglang_adapter.embedding import GCacheEmbeddingStore

    store = GCacheEmbeddingStore({"nodes": sgl_cluster_addresses, "model": "test/vlm", "timeout_s": 5.0,
                                  "connect_timeout_s": 2.0, **cfg})
    pool = torch.zeros(rows, hidden, dtype=torch.bfloat16)
    store.register_buffer(pool, modality="vision")
    return store, pool


def test_token_file_in_the_config_is_used_and_a_refused_token_is_logged_and_counted(sgl, make_cluster, tmp_path,
                                                                                      monkeypatch, caplog):
    """The embedding store refused the "token_file" key the other adapter documents, so it could
    reach a cluster with a token only through the environment; and a refused token was silent:
    every call answered False, nothing in the log, the errors metric 0."""
    import logging

    for var in ("GCACHE_TOKEN", "GCACHE_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    addrs = make_cluster(nodes=1, mem="16MiB", extra_args=["--token-file", str(token), "--no-pretouch"]).addresses
    store, pool = _direct_store(addrs, token_file=str(token))
    row = pool.shape[1] * pool.element_size()
    try:
        pool[:2].fill_(3.0)
        assert store.batch_put(["h"], [pool.data_ptr()], [2 * row]) == [True]
        pool.zero_()
        assert store.batch_get(["h"], [pool.data_ptr()], [2 * row]) == [True] and bool((pool[:2] == 3.0).all())
        assert store.metrics()["errors"] == 0
    finally:
        store.close()
    caplog.set_level(logging.WARNING, logger="sglang_adapter.embedding")
    for local in ("off", "force"):  # over TCP, and over the local shared-memory path
        without, pool = _direct_store(addrs, local=local)
        try:
            caplog.clear()
            assert without.batch_get(["h"], [pool.data_ptr()], [2 * row]) == [False]
            assert without.batch_put(["g"], [pool.data_ptr()], [2 * row]) == [False]
            assert without.batch_is_exist(["h"]) == [False]
            assert without.metrics()["errors"] >= 3, (local, without.metrics())
            lines = [r.getMessage() for r in caplog.records if "token" in r.getMessage()]
            assert len(lines) == 1 and "token_file" in lines[0] and "GCACHE_TOKEN_FILE" in lines[0], \
                (local, [r.getMessage() for r in caplog.records])
        finally:
            without.close()


def test_an_empty_embedding_is_refused_and_an_entry_that_cannot_be_one_is_deleted_when_read(sgl, make_cluster):
    """A 0-byte put stored an empty value under the embedding's content hash: from then on
    skip_existing took the hash for stored and never sent the real embedding, and every get
    missed (size mismatch), for good. Empty embeddings are refused now, and an entry that cannot
    be an embedding of the reader's format (empty, or not whole rows), written by anything else,
    is deleted by the first get, so the next put stores the real one."""
    from gcache import Client, LocalPath, Status

    addrs = make_cluster(nodes=1, mem="16MiB", extra_args=["--no-pretouch"]).addresses
    store, pool = _direct_store(addrs)
    row = pool.shape[1] * pool.element_size()
    key = store.get_key("h")
    try:
        assert store.batch_put(["h"], [pool.data_ptr()], [0]) == [False]
        assert store.batch_get(["h"], [pool.data_ptr()], [0]) == [False]
        assert store.metrics()["empty"] == 2
        with Client(addrs, namespace="sglang-emb", local=LocalPath.OFF) as raw:
            assert raw.exists([key]) == [False], "an empty embedding was stored"
            for poison in (b"", b"x" * (row + 1)):  # an older writer's empty value; a partial row
                assert raw.put([key], [poison]) == [Status.OK]
                assert raw.exists([key]) == [True]
                assert store.batch_get(["h"], [pool.data_ptr()], [2 * row]) == [False]
                assert raw.exists([key]) == [False], f"an entry of {len(poison)} bytes was left in place"
        pool[:2].fill_(5.0)
        assert store.batch_put(["h"], [pool.data_ptr()], [2 * row]) == [True]
        assert store.metrics()["put_stored"] == 1 and store.metrics()["bad_entries"] == 2
        pool.zero_()
        assert store.batch_get(["h"], [pool.data_ptr()], [2 * row]) == [True] and bool((pool[:2] == 5.0).all())
    finally:
        store.close()


@pytest.mark.parametrize("writer_args, reader_args", [
    ({"model_path": "Qwen/Qwen2-VL-7B-Instruct", "served_model_name": "vlm"},
     {"model_path": "Qwen/Qwen2.5-VL-7B-Instruct", "served_model_name": "vlm"}),  # one served name
    ({"model_path": "org/vlm", "revision": "v1"}, {"model_path": "org/vlm", "revision": "v2"}),
    ({"model_path": "org/vlm", "quantization": "fp8"}, {"model_path": "org/vlm"}),
    ({"model_path": "org/vlm", "load_format": "dummy"}, {"model_path": "org/vlm"}),  # random weights
], ids=["two_checkpoints_one_name", "revision", "quantization", "dummy_weights"])
def test_encoders_loading_other_weights_under_one_name_never_share_embeddings(sgl, make_cluster, writer_args,
                                                                              reader_args):
    """Found by a probe: the key named only the served model, so two checkpoints (revisions,
    quantized or random weights) served under one name read each other's embeddings. The
    model identity of the server arguments (pages.model_identity) is part of the key now."""
    import torch

    from sglang_adapter.embedding import GCacheEmbeddingStore
    from tests.sglang_adapter.test_formats import server_args

    addrs = make_cluster(nodes=1, mem="16MiB", extra_args=["--no-pretouch", "--pool-budget", "emb=8MiB"]).addresses
    made = []
    for fields in (writer_args, reader_args, writer_args):
        with server_args(**fields):
            store = GCacheEmbeddingStore({"nodes": addrs, "timeout_s": 5.0})
        pool = torch.zeros(8, 16, dtype=torch.bfloat16)
        store.register_buffer(pool, modality="vision")
        made.append((store, pool))
    (writer, wpool), (reader, rpool), (again, apool) = made
    try:
        assert writer.config.model == reader.config.model or "served_model_name" not in writer_args
        wpool[:4].copy_(torch.randn(4, 16))
        size = 4 * 16 * 2
        assert writer.batch_put(["h"], [wpool.data_ptr()], [size]) == [True]
        assert reader.batch_is_exist(["h"]) == [False]
        assert reader.batch_get(["h"], [rpool.data_ptr()], [size]) == [False]
        assert not rpool.any()
        assert again.batch_get(["h"], [apool.data_ptr()], [size]) == [True]  # the same deployment shares
        assert torch.equal(apool[:4], wpool[:4])
    finally:
        for store, _ in made:
            store.close()


def test_one_bad_hash_is_a_miss_alone_and_a_too_large_put_is_counted(sgl, make_cluster, caplog):
    """A probe: a hash that cannot be encoded failed every embedding of its batch (put and
    exists), a non-string one every embedding of an exists; an embedding over the daemons'
    --max-value was not stored and nothing said why."""
    import logging

    addrs = make_cluster(nodes=1, mem="16MiB", extra_args=["--no-pretouch", "--max-value", "64KiB"]).addresses
    store, pool = _direct_store(addrs, rows=4096, hidden=16)  # 128 KiB of bf16: over --max-value when whole
    row = pool.shape[1] * pool.element_size()
    try:
        pool[:2].fill_(3.0)
        put = store.batch_put(["good", "bad\udc80"], [pool.data_ptr()] * 2, [2 * row] * 2)
        assert put == [True, False]
        assert store.batch_is_exist(["good", "bad\udc80", 7]) == [True, False, False]
        with caplog.at_level(logging.WARNING, logger="sglang_adapter.embedding"):
            assert store.batch_put(["huge"], [pool.data_ptr()], [4096 * row]) == [False]
        assert store.metrics()["too_large"] == 1
        assert "--max-value" in caplog.text
    finally:
        store.close()
