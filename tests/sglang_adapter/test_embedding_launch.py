"""Turning the embedding store on in SGLang (launcher: factory registration, command line), and
the store's answers to input it cannot use (no daemon needed: nothing reaches the network)."""

from __future__ import annotations

import json

import pytest

from sglang_adapter.emb_config import identity_tag
from tests.sglang_adapter.conftest import HAVE_SGLANG

pytestmark = pytest.mark.skipif(not HAVE_SGLANG, reason="sglang 0.5.23 / torch not installed: make sglang-deps")
NOWHERE = "127.0.0.1:1"  # never contacted by these tests


@pytest.fixture
def launch(sgl):
    from sglang_adapter import launch

    return launch


def test_factory_creates_the_gcache_store_from_the_environment(launch, monkeypatch):
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    from sglang_adapter.embedding import GCacheEmbeddingStore

    launch.install()  # idempotent
    monkeypatch.setenv("GCACHE_EMB_CONFIG", json.dumps({"nodes": NOWHERE, "model": "test/vlm", "pool": "img"}))
    store = EmbeddingStoreFactory.create_backend("gcache")  # the way the encoder server calls it
    try:
        assert isinstance(store, GCacheEmbeddingStore)
        assert (store.config.model, store.config.pool) == ("test/vlm", "img")
    finally:
        store.close()


def test_command_line_accepts_gcache_and_still_refuses_unknown_backends(launch):
    from sglang.srt.server_args import prepare_server_args

    args = ["--model-path", "/nonexistent", "--encoder-only", "--enable-mm-global-cache"]
    sa = prepare_server_args([*args, "--mm-global-cache-backend", "gcache"])
    assert sa.enable_mm_global_cache and sa.mm_global_cache_backend == "gcache"
    assert prepare_server_args([*args, "--mm-global-cache-backend", "mooncake"]).mm_global_cache_backend == "mooncake"
    with pytest.raises(SystemExit):
        prepare_server_args([*args, "--mm-global-cache-backend", "bogus"])


def test_launcher_takes_its_own_option_and_checks_it(launch):
    cfg = json.dumps({"nodes": NOWHERE})
    assert launch.split_args(["--model-path", "m", f"--gcache-emb-config={cfg}", "--port", "1"]) == (
        cfg, ["--model-path", "m", "--port", "1"])
    assert launch.split_args(["--model-path", "m"]) == (None, ["--model-path", "m"])
    assert launch.main(["--gcache-emb-config", '{"nodes": "h:1", "bogus": 1}']) == 2


def _store(**cfg):
    from sglang_adapter.embedding import GCacheEmbeddingStore

    return GCacheEmbeddingStore({"nodes": NOWHERE, "model": "test/vlm", **cfg})


def test_store_refuses_buffers_it_cannot_describe(sgl):
    import torch

    store = _store()
    try:
        pool = torch.zeros(64, 16, dtype=torch.bfloat16)
        other = torch.zeros(64, 16, dtype=torch.bfloat16)  # never registered
        assert store.batch_is_exist(["h"]) == [False]  # no pool registered: no format to ask about
        store.register_buffer(pool, modality="vision")
        row = 16 * 2
        # outside every pool / straddling its end / not a whole number of rows: refused, not sent
        cases = [([other.data_ptr()], [row]), ([pool.data_ptr() + 63 * row], [2 * row]),
                 ([pool.data_ptr()], [row + 1]), ([], [])]
        for ptrs, sizes in cases:
            assert store.batch_get_into_multi_buffers(["h"], [ptrs], [sizes]) == [False]
            assert store.batch_put_from_multi_buffers(["h"], [ptrs], [sizes]) == [False]
        assert store.metrics()["unregistered"] == 2 * len(cases)
        assert store.metrics()["errors"] == 0
        # mismatched argument lengths: every answer False, the call does not raise
        assert store.batch_get_into_multi_buffers(["a", "b"], [[pool.data_ptr()]], [[row]]) == [False, False]
        assert store.metrics()["errors"] == 1
        with pytest.raises(ValueError, match="2-D"):
            store.register_buffer(torch.zeros(8))
        assert store.get_key("h") == f"h.emb.vision@test/vlm#bfloat16x16.{identity_tag(store.identity)}.v2"
    finally:
        store.close()
