"""Two deployments whose pages differ in bytes never read each other's pages, even where the
host pools look alike (found by a probe: each of these read the other deployment's KV before).

Real sglang pools, the adapter created through SGLang's factory, real daemons; SGLang's server
arguments are the real ``ServerArgs`` published the way a scheduler publishes them."""

from __future__ import annotations

import contextlib

import pytest

from tests.sglang_adapter.conftest import make_storage, mha_host_pool, mla_host_pool

PAGE = 4


@pytest.fixture
def cluster(sgl, tmp_path):
    from gcache.cluster import LocalCluster
    from tests.sglang_adapter.conftest import POOL_ARGS

    c = LocalCluster(nodes=1, mem="32MiB", root=str(tmp_path / "c"), extra_args=POOL_ARGS).start()
    yield c
    c.stop()


@contextlib.contextmanager
def server_args(**fields):
    """SGLang's process-wide server arguments set to a ServerArgs with ``fields`` (as a scheduler
    publishes them), restored afterwards."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    prev = rc._CONTEXT._server_args
    rc._CONTEXT.set_server_args(ServerArgs(**{"model_path": "test/tiny", **fields}))
    try:
        yield
    finally:
        rc._CONTEXT._server_args = prev


def hashes(n, start=100):
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(list(range(start, start + n * PAGE)), None, page_size=PAGE)


def write_then_probe(cluster, writer, reader, keys):
    """The writer's pages set; how many the reader sees (batch_exists) and gets."""
    import torch

    idx = torch.arange(8, 8 + len(keys) * PAGE)
    assert writer.batch_set_v1(keys, idx) == [True] * len(keys)
    return reader.batch_exists(keys), reader.batch_get_v1(keys, idx)


def test_fp8_variants_of_the_kv_cache_never_share_pages(cluster):
    """SGLang stores fp8_e4m3 and fp8_e5m2 alike as uint8: the host pools are the same."""
    import torch

    storages = {}
    for name, kv_dtype in (("e4m3", "fp8_e4m3"), ("e5m2", "fp8_e5m2"), ("e4m3 again", "fp8_e4m3")):
        with server_args(kv_cache_dtype=kv_dtype):
            s = make_storage(cluster.addresses)
        s.register_mem_pool_host(mha_host_pool(dtype=torch.uint8))
        storages[name] = s
    keys = hashes(3)
    assert write_then_probe(cluster, storages["e4m3"], storages["e5m2"], keys) == (0, [False] * 3)
    # the same deployment twice still shares
    assert storages["e4m3 again"].batch_exists(keys) == 3
    for s in storages.values():
        s.close()


def test_mla_models_whose_name_ends_like_a_shard_field_never_share_pages(cluster):
    """MLA KV keys name no TP rank, so the model name is followed directly by the pipeline and
    context-parallel fields: a model called ``org/m_pp0of2`` (one stage) and ``org/m`` at stage 0
    of 2 are two shards, and so are ``org/m_cp0of2`` and ``org/m`` at CP rank 0 of 2."""
    cases = [({"model_name": "org/m_pp0of2"}, {"model_name": "org/m", "pp_rank": 0, "pp_size": 2}),
             ({"model_name": "org/m_cp0of2"}, {"model_name": "org/m", "attn_cp_rank": 0, "attn_cp_size": 2})]
    for i, (named, sharded) in enumerate(cases):
        a, b, again = (make_storage(cluster.addresses, is_mla_model=True, **over)
                       for over in (named, sharded, sharded))
        for s in (a, b, again):
            s.register_mem_pool_host(mla_host_pool())
        keys = hashes(3, 600 + 100 * i)
        assert write_then_probe(cluster, b, a, keys) == (0, [False] * 3)
        assert again.batch_exists(keys) == 3  # the same shard still shares
        for s in (a, b, again):
            s.close()


def test_two_checkpoints_served_under_one_name_never_share_pages(cluster):
    """SGLang names the storage config's model by --served-model-name: two checkpoints of the same
    geometry served under one name still hold other K and V (the checkpoint loaded, model_path,
    is part of the page format)."""
    import torch

    storages = {}
    for name, path in (("llama", "meta-llama/Llama-3.1-8B-Instruct"),
                       ("mistral", "mistralai/Mistral-7B-Instruct-v0.3"),
                       ("llama again", "meta-llama/Llama-3.1-8B-Instruct")):
        with server_args(model_path=path, served_model_name="default"):
            s = make_storage(cluster.addresses, model_name="default")
        s.register_mem_pool_host(mha_host_pool(dtype=torch.bfloat16))
        storages[name] = s
    keys = hashes(3, 800)
    assert write_then_probe(cluster, storages["mistral"], storages["llama"], keys) == (0, [False] * 3)
    assert storages["llama again"].batch_exists(keys) == 0
    assert write_then_probe(cluster, storages["llama"], storages["llama again"], keys)[0] == 3
    for s in storages.values():
        s.close()


def test_speculative_drafts_of_another_checkpoint_never_share_pages(cluster):
    """With speculative decoding the MHA host pool packs the draft model's layer into every page:
    the same target with another draft checkpoint (or algorithm) holds other bytes in it."""
    storages = {}
    for name, draft in (("A", {"speculative_draft_model_path": "org/eagle-draft-A"}),
                        ("B", {"speculative_draft_model_path": "org/eagle-draft-B"}),
                        ("A as EAGLE3", {"speculative_draft_model_path": "org/eagle-draft-A",
                                         "speculative_algorithm": "EAGLE3"}),
                        ("A again", {"speculative_draft_model_path": "org/eagle-draft-A"})):
        with server_args(model_path="org/target", **{"speculative_algorithm": "EAGLE", **draft}):
            s = make_storage(cluster.addresses, model_name="org/target")
        pool = mha_host_pool(draft_layers=1)
        assert pool.layer_num == 4  # 3 target layers and the draft's
        s.register_mem_pool_host(pool)
        storages[name] = s
    keys = hashes(3, 900)
    assert write_then_probe(cluster, storages["B"], storages["A"], keys) == (0, [False] * 3)
    assert storages["A as EAGLE3"].batch_exists(keys) == 0
    assert write_then_probe(cluster, storages["A"], storages["A again"], keys)[0] == 3
    assert storages["A as EAGLE3"].batch_exists(keys) == 0
    for s in storages.values():
        s.close()


def test_pipeline_stages_holding_other_layers_never_share_pages(cluster):
    """Same stage, same number of layers, another layer partition (SGLANG_PP_LAYER_PARTITION)."""
    a = make_storage(cluster.addresses, pp_rank=1, pp_size=3)
    a.register_mem_pool_host(mha_host_pool(layers=11, start_layer=10))
    b = make_storage(cluster.addresses, pp_rank=1, pp_size=3)
    b.register_mem_pool_host(mha_host_pool(layers=11, start_layer=11))
    assert write_then_probe(cluster, a, b, hashes(2, 200)) == (0, [False, False])
    a.close()
    b.close()


def test_mamba_pools_with_another_ssm_state_dtype_never_share_pages(cluster):
    import torch
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    def host(ssm_dtype):  # fp16 and bf16 states: the same sizes, the same conv dtype
        info = MambaStateBufferInfo(temporal=torch.zeros(2, 16, 4, 8, dtype=ssm_dtype),
                                    conv=(torch.zeros(2, 16, 3, 8, dtype=torch.bfloat16),))
        return MambaPoolHost(info, 2.0, 0, device_capacity=16, pin_memory=False, layout="page_first")

    a, b = make_storage(cluster.addresses), make_storage(cluster.addresses)
    a.register_mem_host_pool_v2(host(torch.float16), PoolName.MAMBA)
    b.register_mem_host_pool_v2(host(torch.bfloat16), PoolName.MAMBA)
    keys = hashes(2, 300)[-1:]

    def transfer():
        return PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([3]), keys=keys,
                            hit_policy=PoolHitPolicy.TRAILING_PAGES)

    assert a.batch_set_v2([transfer()]) == {"mamba": [True]}
    assert b.batch_get_v2([transfer()]) == {"mamba": [False]}
    a.close()
    b.close()


def generic_controller(cluster, layout):
    """A HiCacheController on SGLang's generic page path (no interface_v1) over its own host
    pool of ``layout``: (controller, host pool, storage backend)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    host = mha_host_pool(layout, layers=3, page=PAGE, tokens=64)
    st = make_storage(cluster.addresses, {"interface_v1": 0})
    st.register_mem_pool_host(host)
    c = object.__new__(HiCacheController)
    c.__dict__.update(storage_backend=st, storage_host_pool=host, mem_pool_host=host, page_size=PAGE)
    return c, host, st


def test_the_legacy_copy_path_never_mixes_page_layouts(cluster):
    """SGLang's generic page path (the backend without interface_v1) flattens each page: a
    page_first and a layer_first page of the same model have the same dtype and element count."""
    from types import SimpleNamespace

    import torch

    writer, wh, ws = generic_controller(cluster, "page_first")
    reader, rh, rs = generic_controller(cluster, "layer_first")
    same, sh, ss = generic_controller(cluster, "page_first")
    keys, idx = hashes(2, 400), torch.arange(8, 8 + 2 * PAGE)
    wh.kv_buffer.copy_(torch.rand(wh.kv_buffer.shape))
    assert writer._generic_page_set(keys, idx)
    op = SimpleNamespace(request_id="r", is_terminated=lambda: False)
    assert reader._generic_page_get(op, keys, idx) == 0 and not rh.kv_buffer.any()
    assert same._generic_page_get(op, keys, idx) == 2  # a reader of the same layout still hits
    assert torch.equal(sh.kv_buffer[:, 8:8 + 2 * PAGE], wh.kv_buffer[:, 8:8 + 2 * PAGE])
    for s in (ws, rs, ss):
        s.close()


def test_the_legacy_copy_path_finds_what_it_stored(cluster):
    """On the generic path SGLang asks batch_exists before it prefetches (_storage_hit_query):
    it must name the keys batch_set wrote, or the deployment never hits L3; a pool of another
    layout still finds nothing."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    writer, wh, ws = generic_controller(cluster, "page_first")
    reader, rh, rs = generic_controller(cluster, "page_first")
    other, _, os_ = generic_controller(cluster, "layer_first")
    tokens = list(range(4100, 4100 + 3 * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    wh.kv_buffer.copy_(torch.rand(wh.kv_buffer.shape))
    assert writer._generic_page_set(keys[:2], torch.arange(8, 8 + 2 * PAGE))

    def query(c):
        op = SimpleNamespace(last_hash=None, token_ids=tokens, prefix_keys=None, request_id="r",
                             is_terminated=lambda: False)
        return c._storage_hit_query(op)[1]

    assert query(reader) == 2 * PAGE and reader.storage_backend.exists(keys[0])
    assert query(other) == 0 and not other.storage_backend.exists(keys[0])
    op = SimpleNamespace(request_id="r", is_terminated=lambda: False)
    assert reader._generic_page_get(op, keys[:2], torch.arange(16, 16 + 2 * PAGE)) == 2
    assert torch.equal(rh.kv_buffer[:, 16:16 + 2 * PAGE], wh.kv_buffer[:, 8:8 + 2 * PAGE])
    for s in (ws, rs, os_):
        s.close()


def test_the_routers_l3_probe_finds_the_pages_the_backend_wrote(cluster):
    """The router asks gcache for ``{page hash}.kv@{--l3-shard}``: with the shard the backend
    names (l3_shard: shard and page format), it sees exactly the leading run of stored pages."""
    from router.l3 import L3Config, L3Probe

    s = make_storage(cluster.addresses, model_name="Org/Model-7B")
    s.register_mem_pool_host(mha_host_pool())
    ids = list(range(500, 500 + 5 * PAGE))
    keys = hashes(5, 500)
    assert write_then_probe(cluster, s, s, keys[:3])[0] == 3
    probe = L3Probe(L3Config(tuple(cluster.addresses), s.l3_shard(), namespace=s.config.namespace,
                             timeout_s=2.0), PAGE)
    try:
        assert probe.keys(ids)[:3] == s.page_keys(keys[:3], "kv")
        assert probe.client.exists(probe.keys(ids)) == [True] * 3 + [False] * 2
    finally:
        probe.client.close()
        s.close()


def test_an_unnamed_model_is_keyed_by_the_served_model():
    """With no model_name in the storage config the shard names the model the server serves, so
    two unnamed models with the same pool layout do not share pages."""
    from types import SimpleNamespace

    from sglang_adapter.pages import served_model

    assert served_model(SimpleNamespace(served_model_name=None, model_path="Org/A-7B")) == "Org/A-7B"
    assert served_model(SimpleNamespace(served_model_name="a", model_path="Org/A-7B")) == "a"
    assert served_model(SimpleNamespace()) == ""


@pytest.mark.parametrize("writer_args, reader_args", [
    ({"load_format": "dummy"}, {}),  # random weights
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "org/d",
      "speculative_draft_load_format": "dummy"},
     {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "org/d"}),
    ({"modelopt_checkpoint_restore_path": "/ckpt/a"}, {}),
    ({"kt_weight_path": "/w/a"}, {"kt_weight_path": "/w/b"}),  # KTransformers' CPU expert weights
    ({"kt_weight_path": "/w/a", "kt_method": "AMXINT8"}, {"kt_weight_path": "/w/a"}),
], ids=["load_format", "draft_load_format", "modelopt_restore", "kt_weight_path", "kt_method"])
def test_deployments_loading_other_weights_never_share_pages(cluster, writer_args, reader_args):
    """Found by a probe: these arguments change the weights (so K and V) but were not part of the
    page identity, so a deployment with random "dummy" weights wrote pages a real one read."""
    storages = []
    for fields in (writer_args, reader_args, writer_args):
        with server_args(model_path="org/m", **fields):
            s = make_storage(cluster.addresses, model_name="org/m")
        s.register_mem_pool_host(mha_host_pool(draft_layers=1 if "speculative_algorithm" in fields else 0))
        storages.append(s)
    writer, reader, again = storages
    keys = hashes(3, 1000 + 10 * len(writer_args) + len(str(writer_args)))
    assert write_then_probe(cluster, writer, reader, keys) == (0, [False] * 3)
    assert again.batch_exists(keys) == 3  # the same deployment still shares
    for s in storages:
        s.close()


def test_what_only_changes_scheduling_or_kernels_does_not_split_the_cache(sgl):
    """The identity names only what changes the bytes: defaults, backends, sizes and parallelism
    leave it as it is (a difference there would only split caches), 0 GPU experts is a value,
    and KTransformers' settings count only when it is used."""
    from sglang.srt.server_args import ServerArgs

    from sglang_adapter.pages import deployment_identity, model_identity

    base = deployment_identity(ServerArgs(model_path="org/m"))
    assert base == ["model_path=org/m"]
    for fields in ({"attention_backend": "triton"}, {"max_running_requests": 7}, {"chunked_prefill_size": 1024},
                   {"load_format": "auto"}, {"weight_version": "default"}, {"kt_method": "AMXINT8"},
                   {"kt_num_gpu_experts": 3}):
        assert deployment_identity(ServerArgs(model_path="org/m", **fields)) == base, fields
    kt = deployment_identity(ServerArgs(model_path="org/m", kt_weight_path="/w", kt_num_gpu_experts=0))
    assert "kt_num_gpu_experts=0" in kt and "kt_method=AMXINT4" in kt
    # the embeddings' part: the weights, not the KV cache's dtype or a draft
    assert model_identity(ServerArgs(model_path="org/m", kv_cache_dtype="fp8_e4m3")) == base
    assert model_identity(ServerArgs(model_path="org/m", load_format="dummy")) != base


def test_mla_side_pools_written_by_the_storage_writer_are_found_by_every_tp_rank(cluster):
    """Found by a probe: SGLang backs up an MLA model's replicated side pools (the DSA indexer,
    DeepSeek-V4's compressed pools) on the storage writer (TP rank 0) only
    (HybridCacheController.should_backup), but the adapter keyed them per TP rank: rank 1 never
    found them, and SGLang's MIN over the ranks made every prefetch of the deployment 0 pages.
    They are keyed without the rank now, like the MLA KV pool; a pool whose bytes differ per
    rank (an MHA draft: heads split over the ranks) keeps the rank."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    ranks = []
    for r in range(2):
        s = make_storage(cluster.addresses, is_mla_model=True, tp_rank=r, tp_size=2, model_name="org/dsv32")
        kv, indexer = mla_host_pool(), mla_host_pool(layers=1)
        s.register_mem_pool_host(kv)
        s.register_mem_host_pool_v2(kv, PoolName.KV)
        s.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
        s.register_mem_host_pool_v2(mha_host_pool(layers=1), PoolName.DRAFT)
        ctl = object.__new__(HybridCacheController)  # SGLang's own rule of who backs up what
        ctl.__dict__.update(storage_config=s.storage_config, storage_backend_type="dynamic")
        ranks.append((s, ctl))
    keys = hashes(3, 7000)
    hidx = torch.arange(8, 8 + 3 * PAGE)
    for s, ctl in ranks:
        t = PoolTransfer(name=PoolName.INDEXER, host_indices=hidx, keys=keys, indices_from_pool=PoolName.KV)
        if s.storage_config.is_storage_writer:
            assert s.batch_set_v1(keys, hidx) == [True] * 3
        if ctl.should_backup(t):
            assert s.batch_set_v2([t]) == {"indexer": [True] * 3}
    assert [ctl.should_backup(PoolTransfer(name=PoolName.INDEXER, keys=keys)) for _, ctl in ranks] == [True, False]
    for s, _ in ranks:
        t = PoolTransfer(name=PoolName.INDEXER, keys=keys, indices_from_pool=PoolName.KV,
                         hit_policy=PoolHitPolicy.ALL_PAGES)
        res = s.batch_exists_v2(keys, [t])
        assert (res.kv_hit_pages, res.restorable_prefix_pages) == (3, [1, 2, 3]), s.storage_config.tp_rank
        assert s.batch_get_v2([PoolTransfer(name=PoolName.INDEXER, host_indices=hidx, keys=keys)]) == \
            {"indexer": [True] * 3}
    (s0, _), (s1, _) = ranks
    assert s0.page_keys(keys, "indexer") == s1.page_keys(keys, "indexer")
    assert s0.page_keys(keys, "draft") != s1.page_keys(keys, "draft")  # MHA heads differ per rank
    for s, _ in ranks:
        s.close()
