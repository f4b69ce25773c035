"""Pure logic of the adapter, no sglang: window-safe matching, key naming, configuration.

The pool budgets and pool-aware eviction it relies on are gcache.tier's: tests/test_pools.py."""

from __future__ import annotations

import pytest

from gcache.errors import ConfigError
from sglang_adapter.config import AdapterConfig
from sglang_adapter.keys import KeyScheme, page_format
from sglang_adapter.window import PoolCheck, window_safe

T, F = True, False


# -- window-safe length ---------------------------------------------------------------------------
def test_all_pages_and_kv_prefix():
    r = window_safe([T, T, T, F, T], [PoolCheck("idx", [T, T, F, T, T])])
    assert (r.kv_pages, r.restorable, r.final_pages) == (3, [1, 2], 2)


def test_trailing_window_leaves_holes():
    # window of 2: stop point L needs SWA pages L-2, L-1
    swa = [F, T, T, F, T, T]
    r = window_safe([T] * 6, [PoolCheck("swa", swa, trailing=2)])
    assert r.restorable == [3, 6] and r.final_pages == 6 and r.pool_hits == {"kv": 6, "swa": 6}


def test_missing_swa_page_inside_window_refuses_that_length():
    swa = [F, F, F, T, F, T]  # page 4 missing inside the window of L=6 (pages 3..5)
    assert window_safe([T] * 6, [PoolCheck("swa", swa, trailing=3)]).restorable == []


def test_kv_gap_bounds_everything():
    r = window_safe([T, F, T, T], [PoolCheck("swa", [T, T, T, T], trailing=1)])
    assert r.restorable == [1] and r.kv_pages == 1


# -- keys and config ------------------------------------------------------------------------------------
def test_keys_name_rank_pool_and_share_mla_kv():
    mha0, mha1 = KeyScheme("m", 0, 2), KeyScheme("m", 1, 2)
    assert mha0.key("ab", "kv") != mha1.key("ab", "kv")
    assert mha0.key("ab", "kv") != mha0.key("ab", "swa")
    mla0, mla1 = KeyScheme("m", 0, 2, is_mla=True), KeyScheme("m", 1, 2, is_mla=True)
    assert mla0.key("ab", "kv") == mla1.key("ab", "kv") == b"ab.kv@m"
    assert mla0.key("ab", "mamba") != mla1.key("ab", "mamba")  # Mamba state is split over the ranks


@pytest.mark.parametrize("pool", ["indexer", "swa", "draft", "deepseek_v4_c4", "deepseek_v4_c4_indexer"])
def test_mla_side_pools_are_rank_shared_like_the_mla_kv(pool):
    """SGLang backs up an MLA model's side pools on TP rank 0 only: keyed per rank, no other rank
    ever found them. Only a pool whose bytes differ per rank keeps the rank: Mamba by name, any
    other when the caller says so (the backend does for an MHA host pool)."""
    mla0, mla1 = KeyScheme("m", 0, 2, is_mla=True), KeyScheme("m", 1, 2, is_mla=True)
    assert mla0.key("ab", pool) == mla1.key("ab", pool) == f"ab.{pool}@m".encode()
    assert mla0.key("ab", pool, rank_sharded=True) != mla1.key("ab", pool, rank_sharded=True)
    mha0, mha1 = KeyScheme("m", 0, 2), KeyScheme("m", 1, 2)
    assert mha0.key("ab", pool) != mha1.key("ab", pool)  # MHA: every pool is per rank


def test_page_format_names_every_property_of_the_bytes():
    base = ("MHATokenToKVPoolHost", "page_first", "torch.bfloat16", 64, [4096, 4096])
    variants = [("AsymmetricMHATokenToKVPoolHost",) + base[1:], base[:1] + ("layer_first",) + base[2:],
                base[:2] + ("torch.float32",) + base[3:], base[:3] + (32,) + base[4:], base[:4] + ([8192],)]
    fmts = {page_format(*v) for v in variants}
    assert page_format(*base) not in fmts and len(fmts) == len(variants)
    assert page_format(*base) == page_format(*base)  # stable: every writer and reader agrees
    s = KeyScheme("m")
    assert s.key("ab", "kv", page_format(*base)) != s.key("ab", "kv", page_format(*variants[1]))
    assert s.key("ab", "kv", "f00d") == b"ab.kv@m_tp0of1#f00d"


def test_page_format_fields_cannot_pass_for_one_another():
    """A ``|`` inside a free-form field (a model path, a JSON override) is escaped: it cannot make
    one deployment's identity read as another's (before: the same digest, so a deployment with
    the default KV dtype read an e5m2 deployment's pages as its own)."""
    base = ("MHATokenToKVPoolHost", "page_first", "torch.bfloat16", 64, [4096])
    pairs = [(["model_path=/ckpt/m|revision=v2"], ["model_path=/ckpt/m", "revision=v2"]),
             (["model_path=m", 'json_model_override_args={"x": 1}|kv_cache_dtype=fp8_e5m2'],
              ["model_path=m", 'json_model_override_args={"x": 1}', "kv_cache_dtype=fp8_e5m2"]),
             (["a\\|b"], ["a\\", "b"]), (["a\\"], ["a\\\\"])]
    for one, other in pairs:
        assert page_format(*base, one) != page_format(*base, other), (one, other)
    shifted = page_format("MHATokenToKVPoolHost", "page_first|torch.bfloat16", "", 64, [4096])
    assert shifted != page_format(*base)
    # fields without ``|`` or ``\\`` keep the digest they had before the escaping (no upgrade misses)
    assert page_format(*base, ["model_path=m", "revision=v2"]) == "94635c5d8b8d911c"  # as computed before


def test_adapter_config_validates(monkeypatch):
    for k in ("GCACHE_NODES", "GCACHE_MASTERS", "GCACHE_TOKEN", "GCACHE_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError):
        AdapterConfig.from_extra({})
    assert AdapterConfig.from_extra({"nodes": "a:1, b:2"}).nodes == ("a:1", "b:2")
    with pytest.raises(ConfigError):
        AdapterConfig.from_extra({"nodes": ["a:1"], "timeout_s": "soon"})
    with pytest.raises(ConfigError):
        AdapterConfig.from_extra({"nodes": 7})
    assert AdapterConfig.from_extra({"nodes": ["a:1"]}).local.value == "auto"
    assert AdapterConfig.from_extra({"nodes": ["a:1"], "local": "off"}).local.value == "off"
    with pytest.raises(ConfigError):
        AdapterConfig.from_extra({"nodes": ["a:1"], "local": "sometimes"})


def test_adapter_config_takes_masters_like_the_client(monkeypatch, tmp_path):
    for k in ("GCACHE_NODES", "GCACHE_MASTERS", "GCACHE_TOKEN", "GCACHE_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    c = AdapterConfig.from_extra({"nodes": "gcache://m:1,m:2"})
    assert c.target() == "gcache://m:1,m:2" and c.nodes == ()
    assert AdapterConfig.from_extra({"masters": "gcache://m:1"}).target() == "gcache://m:1"
    monkeypatch.setenv("GCACHE_MASTERS", "gcache://env:1")
    monkeypatch.setenv("GCACHE_NODES", "a:1")
    assert AdapterConfig.from_extra({}).target() == "gcache://env:1"
    assert AdapterConfig.from_extra({"nodes": ["a:1"]}).target() == ["a:1"]
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    monkeypatch.setenv("GCACHE_TOKEN", "from-env")
    assert AdapterConfig.from_extra({"nodes": ["a:1"]}).token() == "from-env"
    monkeypatch.setenv("GCACHE_TOKEN_FILE", str(tok))
    assert AdapterConfig.from_extra({"nodes": ["a:1"]}).token() == "s3cret"
    assert AdapterConfig.from_extra({"nodes": ["a:1"], "token_file": str(tok)}).token() == "s3cret"


def test_model_names_stay_apart_and_dcp_ranks_hold_their_own_pages():
    from sglang_adapter.keys import model_name

    assert model_name("a/b-c") != model_name("a-b/c")
    assert model_name("a%2Fb") != model_name("a/b") and "/" not in model_name("org/m")
    # a name ending like a shard field is not that field (MLA KV names no TP rank)
    assert model_name("a_b") != model_name("a%5Fb") and "_" not in model_name("org/m_pp0of2")
    assert KeyScheme(model_name("org/m_pp0of2"), is_mla=True).key("ab", "kv") != \
        KeyScheme(model_name("org/m"), pp_rank=0, pp_size=2, is_mla=True).key("ab", "kv")
    mla0, mla1 = KeyScheme("m", 0, 2, is_mla=True, dcp_rank=0, dcp_size=2), \
        KeyScheme("m", 1, 2, is_mla=True, dcp_rank=1, dcp_size=2)
    assert mla0.key("ab", "kv") != mla1.key("ab", "kv")  # each holds other tokens of the page


def test_page_format_extra_fields_are_part_of_the_format():
    base = ("MHATokenToKVPoolHost", "page_first", "torch.uint8", 64, [4096, 4096])
    assert page_format(*base) != page_format(*base, ["kv_cache_dtype=fp8_e4m3"])
    assert page_format(*base, ["kv_cache_dtype=fp8_e4m3"]) != page_format(*base, ["kv_cache_dtype=fp8_e5m2"])
    assert page_format(*base, ["layers=0-10"]) != page_format(*base, ["layers=1-11"])


def test_adapter_config_refuses_unknown_keys_and_accepts_sglangs_own(monkeypatch):
    """Found by a probe: a misspelt key ("namepsace") was ignored, so the deployment silently
    used (and shared) the default namespace. Unknown keys are refused, naming the known ones;
    the keys SGLang itself reads from the same extra_config are accepted."""
    for k in ("GCACHE_NODES", "GCACHE_MASTERS", "GCACHE_CONFIG"):
        monkeypatch.delenv(k, raising=False)
    for typo in ("namepsace", "skip_exisiting"):
        with pytest.raises(ConfigError, match=rf"unknown extra_config key\(s\) \['{typo}'\].*'namespace'"):
            AdapterConfig.from_extra({"nodes": ["a:1"], typo: "x"})
    sglang_keys = {"backend_name": "gcache", "module_path": "sglang_adapter.backend", "class_name": "GCacheStorage",
                   "interface_v1": 1, "prefetch_threshold": 256, "prefetch_timeout_base": 1,
                   "prefetch_timeout_per_ki_token": 0.25, "hicache_storage_pass_prefix_keys": True, "tp_lcm_size": 4}
    assert AdapterConfig.from_extra({"nodes": ["a:1"], "namespace": "ft-b", **sglang_keys}).namespace == "ft-b"


@pytest.mark.parametrize("value", [True, False, float("inf"), float("nan"), -1.0, 0, 86400.5, 2.2e6])
@pytest.mark.parametrize("name", ["timeout_s", "connect_timeout_s"])
def test_timeouts_are_finite_numbers_of_seconds_in_both_configs(monkeypatch, name, value):
    """Found by a probe: timeout_s true was taken for 1 second, and Infinity (json.loads accepts
    it) made every call fail with an OverflowError deep in the client; so did any value past
    ~24.8 days (poll's milliseconds overflow a C int): at most a day is accepted."""
    from sglang_adapter.emb_config import EmbeddingStoreConfig

    monkeypatch.delenv("GCACHE_CONFIG", raising=False)
    with pytest.raises(ConfigError, match=name):
        AdapterConfig.from_extra({"nodes": ["a:1"], name: value})
    with pytest.raises(ConfigError, match=name):
        EmbeddingStoreConfig.load({"nodes": ["a:1"], "model": "m", name: value})


def test_nodes_and_masters_together_are_refused(monkeypatch):
    """Found by a probe: 'masters' beside 'nodes' was silently ignored."""
    monkeypatch.delenv("GCACHE_CONFIG", raising=False)
    with pytest.raises(ConfigError, match="'nodes' or 'masters', not both"):
        AdapterConfig.from_extra({"nodes": ["a:1"], "masters": "gcache://m:1"})


def test_a_model_name_too_long_for_a_key_is_shortened_with_a_digest():
    """Found by a probe: a served name of ~900+ characters made every key longer than gcache's
    1 KiB limit, so every page failed (silently: L3 off)."""
    from gcache.protocol import MAX_KEY_BYTES
    from sglang_adapter.keys import MODEL_NAME_MAX, model_name

    a, b = "m" * 3000 + "-a", "m" * 3000 + "-b"
    assert model_name(a) != model_name(b)
    assert len(model_name(a).encode()) <= MODEL_NAME_MAX
    key = KeyScheme(model_name(a), 7, 8, pp_rank=3, pp_size=4).key("f" * 64, "kv", page_format("C", "l", "d", 1, [1]))
    assert len(key) <= MAX_KEY_BYTES
    assert model_name("x" * MODEL_NAME_MAX) == "x" * MODEL_NAME_MAX  # short enough: unchanged
    longest = KeyScheme("x" * MODEL_NAME_MAX, 7, 8, pp_rank=3, pp_size=4, cp_rank=1, cp_size=2, dcp_rank=1,
                        dcp_size=2).key("f" * 64, "mamba", page_format("C", "l", "d", 1, [1]))
    assert len(longest) <= MAX_KEY_BYTES  # and still fits a key, every shard field included
    # a real name never meets a shortened one: its "~" is encoded
    assert "~" not in model_name("a~" + "0" * 32) and "~" in model_name(a)

