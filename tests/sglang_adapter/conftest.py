"""Fixtures for the SGLang adapter tests: real sglang 0.5.23 classes, real gcache daemons.

sglang is installed by ``make test`` (scripts/install_sglang.sh). Tests that need it use the
``sgl`` fixture, which skips them, saying why, only when sglang cannot be imported.
"""

from __future__ import annotations

import importlib.util

import pytest

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None and importlib.util.find_spec("torch") is not None
POOL_ARGS = ["--pool-budget", "kv=75%", "--pool-budget", "swa=25%", "--no-pretouch"]


@pytest.fixture(scope="session")
def sgl():
    if not HAVE_SGLANG:
        pytest.skip("sglang 0.5.23 / torch not installed: run `make sglang-deps` (part of `make test`)")
    from gcache.bench import torchvision_stub

    torchvision_stub.install()  # sglang's config modules import torchvision; the PyPI build needs CUDA
    import sglang.srt.mem_cache.pool_host.mha  # noqa: F401  (fail here, clearly, if imports break)

    return True


@pytest.fixture(scope="session")
def adapter_cluster(tmp_path_factory):
    """Two real daemons with kv/swa budgets, shared by the tests that use distinct keys."""
    from gcache.cluster import LocalCluster

    c = LocalCluster(nodes=2, mem="32MiB", root=str(tmp_path_factory.mktemp("adapter")), extra_args=POOL_ARGS)
    c.start()
    yield c
    c.stop()


def storage_config(nodes, extra=None, **over):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra_config = {"backend_name": "gcache", "module_path": "sglang_adapter.backend",
                    "class_name": "GCacheStorage", "interface_v1": 1, "nodes": list(nodes),
                    "timeout_s": 1.0, **(extra or {})}
    kw = {"tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1, "attn_cp_rank": 0, "attn_cp_size": 1,
              "is_mla_model": False, "enable_storage_metrics": True, "is_page_first_layout": True,
              "model_name": "test/tiny", "extra_config": extra_config}
    kw.update(over)
    return HiCacheStorageConfig(**kw)


def make_storage(nodes, extra=None, **over):
    """Created the way SGLang creates a third-party backend: the factory's dynamic mechanism."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    return StorageBackendFactory.create_backend("dynamic", storage_config(nodes, extra, **over), None)


def _mha_info(layers, heads, head_dim, v_head_dim, page, tokens, dtype):
    import torch
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

    k = [torch.zeros(tokens + page, heads, head_dim, dtype=dtype) for _ in range(layers)]
    v = [torch.zeros(tokens + page, heads, v_head_dim, dtype=dtype) for _ in range(layers)]
    return MHABufferInfo(
        buffers=KVBuffers(k=tuple(k), v=tuple(v), k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                          v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype,
        device=torch.device("cpu"))


def mha_host_pool(layout="page_first", layers=3, heads=2, head_dim=8, v_head_dim=8, page=4, tokens=64,
                  dtype=None, start_layer=0, draft_layers=0):
    """A real sglang MHA host pool on CPU (AsymmetricMHATokenToKVPoolHost when K/V dims differ);
    with ``draft_layers`` a speculative draft model's layers packed into every page, as SGLang
    does with speculative decoding."""
    import torch
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    dtype = dtype or torch.float32
    info = _mha_info(layers, heads, head_dim, v_head_dim, page, tokens, dtype)
    draft = (_mha_info(draft_layers, heads, head_dim, v_head_dim, page, tokens, dtype),) if draft_layers else ()
    cls = get_mha_host_pool_cls(info)
    return cls(info, 2.0, 0, page, layout, pin_memory=False, device="cpu", device_capacity_tokens=tokens,
               start_layer=start_layer, end_layer=start_layer + layers, draft_buffer_infos=draft)


def mla_host_pool(layers=3, page=4, tokens=64, dtype=None, layout="page_first"):
    """A real sglang MLA host pool on CPU (one latent buffer per page, shared by every TP rank)."""
    import torch
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dtype = dtype or torch.float32
    lora, rope = 16, 8
    bufs = tuple(torch.zeros(tokens + page, 1, lora + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                         layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
                         kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=dtype,
                         device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers,
                                target_layer_num=layers)


def fill_random(pool, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    for buf in (getattr(pool, "kv_buffer", None), getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)):
        if isinstance(buf, torch.Tensor) and buf.is_floating_point():
            buf.copy_(torch.rand(buf.shape, generator=g, dtype=buf.dtype))
