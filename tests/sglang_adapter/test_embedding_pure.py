"""The embedding store's configuration and key naming (pure: no sglang, no sockets)."""

from __future__ import annotations

import json

import pytest

from gcache.client.client import LocalPath
from gcache.errors import ConfigError
from sglang_adapter.emb_config import (
    ENV_CONFIG,
    FORMAT_VERSION,
    EmbeddingFormat,
    EmbeddingStoreConfig,
    embedding_keys,
    identity_tag,
)


def test_keys_name_model_modality_dtype_hidden_identity_and_version():
    fmt = EmbeddingFormat("vision", "bfloat16", 4096)
    (key,) = embedding_keys(["ab12"], "Qwen/Qwen2.5-VL-7B", fmt)
    assert key == f"ab12.emb.vision@Qwen/Qwen2.5-VL-7B#bfloat16x4096.{identity_tag()}.v{FORMAT_VERSION}".encode()
    assert FORMAT_VERSION == 2  # v1 keys had no identity: one of another checkpoint would be read
    ident = identity_tag(["model_path=org/vlm", "load_format=dummy"])
    assert embedding_keys(["h"], "m", fmt, ident) != embedding_keys(["h"], "m", fmt, identity_tag(["model_path=org/vlm"]))
    assert embedding_keys(["h"], "m", fmt, ident) == embedding_keys(["h"], "m", fmt, ident)


@pytest.mark.parametrize("other", [
    ("m", EmbeddingFormat("vision", "float32", 4096)),
    ("m", EmbeddingFormat("vision", "bfloat16", 3584)),
    ("m", EmbeddingFormat("audio", "bfloat16", 4096)),
    ("m2", EmbeddingFormat("vision", "bfloat16", 4096)),
])
def test_any_difference_in_format_or_model_is_another_key(other):
    base = embedding_keys(["h"], "m", EmbeddingFormat("vision", "bfloat16", 4096))
    assert embedding_keys(["h"], *other) != base


def test_format_refuses_empty_fields():
    with pytest.raises(ConfigError):
        EmbeddingFormat("vision", "bfloat16", 0)
    with pytest.raises(ConfigError):
        EmbeddingFormat("", "bfloat16", 8)


def test_config_from_mapping_json_and_environment(monkeypatch):
    monkeypatch.delenv(ENV_CONFIG, raising=False)
    monkeypatch.setenv("GCACHE_NODES", "127.0.0.1:1,127.0.0.1:2")
    c = EmbeddingStoreConfig.load({"model": "m", "local": "off", "timeout_s": 2})
    assert c.nodes == ("127.0.0.1:1", "127.0.0.1:2") and c.local is LocalPath.OFF and c.timeout_s == 2
    assert (c.namespace, c.pool, c.skip_existing) == ("sglang-emb", "emb", True)
    c = EmbeddingStoreConfig.load(json.dumps({"nodes": ["h:3"], "pool": "img"}), default_model="served")
    assert c.nodes == ("h:3",) and c.model == "served" and c.pool == "img"
    monkeypatch.setenv(ENV_CONFIG, json.dumps({"model": "from-env", "namespace": "mm"}))
    c = EmbeddingStoreConfig.load(None)
    assert (c.model, c.namespace) == ("from-env", "mm")


@pytest.mark.parametrize("bad, why", [
    ({"model": "m", "nodes": []}, "no nodes"),
    ({"nodes": "h:1"}, "no model"),
    ({"nodes": "h:1", "model": "m", "timeout_s": 0}, "seconds > 0"),
    ({"nodes": "h:1", "model": "m", "timeout_s": True}, "wrong type"),
    ({"nodes": "h:1", "model": "m", "timeout_s": float("inf")}, "finite number of seconds"),
    ({"nodes": "h:1", "model": "m", "connect_timeout_s": float("nan")}, "finite number of seconds"),
    ({"nodes": "h:1", "model": "m", "local": "sometimes"}, "auto, off or force"),
    ({"nodes": "h:1", "model": "m", "bogus": 1}, "unknown config keys"),
    ({"nodes": "h:1", "model": "m", "token_file": 7}, "'token_file' has the wrong type"),
    ({"nodes": "h:1", "model": "x" * 600}, "longer than"),
    ({"nodes": "h:1", "model": "b.emb.vision@a"}, "separate the parts of a key"),  # would spell another's key
    ({"nodes": "h:1", "model": "m#1"}, "separate the parts of a key"),
    ("{not json", "not JSON"),
    ("[1]", "JSON object"),
])
def test_bad_config_is_a_clear_error(bad, why, monkeypatch):
    monkeypatch.delenv("GCACHE_NODES", raising=False)
    with pytest.raises(ConfigError, match=why):
        EmbeddingStoreConfig.load(bad)


def test_token_file_is_taken_and_resolved_like_every_other_entry_point(tmp_path, monkeypatch):
    """The other adapter documents "token_file"; the embedding store refused it as unknown."""
    for var in ("GCACHE_TOKEN", "GCACHE_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    f = tmp_path / "token"
    f.write_text("t0ken\n")
    c = EmbeddingStoreConfig.load({"nodes": "h:1", "model": "m", "token_file": str(f)})
    assert c.token_file == str(f) and c.token() == "t0ken"
    monkeypatch.setenv("GCACHE_TOKEN", "from-env")
    assert EmbeddingStoreConfig.load({"nodes": "h:1", "model": "m"}).token() == "from-env"
    with pytest.raises(ConfigError, match="cannot read token file"):
        EmbeddingStoreConfig.load({"nodes": "h:1", "model": "m", "token_file": str(tmp_path / "absent")}).token()


def test_a_content_hash_is_usable_only_without_the_keys_separators():
    """A hash holding '.emb.' (with a model name holding '@') spelled another deployment's key; a
    lone surrogate raised inside the batch and failed every embedding of it."""
    from sglang_adapter.emb_config import hash_ok

    assert hash_ok("1234567890") and hash_ok("deadbeef")
    for bad in ("", "X.emb.vision@b", "a#b", "a@b", "a\udc80", 7, None):
        assert not hash_ok(bad), bad
