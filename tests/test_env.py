"""One token and cluster resolution for every entry point (gcache.env)."""

import pytest

from gcache.env import resolve_cluster, resolve_token
from gcache.errors import ConfigError
from gcache.meta.rpc import load_token


@pytest.fixture
def clean_env(monkeypatch):
    for k in ("GCACHE_TOKEN", "GCACHE_TOKEN_FILE", "GCACHE_MASTERS", "GCACHE_NODES"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_token_order_is_flag_then_token_file_env_then_token_env(clean_env, tmp_path):
    flag, env_file = tmp_path / "flag", tmp_path / "env"
    flag.write_text("from-flag\n")
    env_file.write_text("from-env-file\nsecond line ignored\n")
    assert resolve_token() is None
    clean_env.setenv("GCACHE_TOKEN", "from-env")
    assert resolve_token() == "from-env"
    clean_env.setenv("GCACHE_TOKEN_FILE", str(env_file))
    assert resolve_token() == "from-env-file"
    assert resolve_token(str(flag)) == "from-flag"
    assert load_token(None) == "from-env-file"  # the master, daemon and client path is the same one


def test_unreadable_or_empty_token_file_is_a_clear_error(clean_env, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        resolve_token(str(empty))
    clean_env.setenv("GCACHE_TOKEN_FILE", str(tmp_path / "absent"))
    clean_env.setenv("GCACHE_TOKEN", "ignored when the file is named")
    with pytest.raises(ConfigError, match="cannot read token file"):
        resolve_token()


def test_cluster_order_nodes_then_masters_then_env(clean_env):
    with pytest.raises(ConfigError, match="--masters"):
        resolve_cluster()
    clean_env.setenv("GCACHE_NODES", "a:1,b:2")
    assert resolve_cluster() == ["a:1", "b:2"]
    clean_env.setenv("GCACHE_MASTERS", "gcache://m:1,m:2")
    assert resolve_cluster() == "gcache://m:1,m:2"  # `gcache up` exports both: masters win
    assert resolve_cluster(masters="gcache://x:9") == "gcache://x:9"
    assert resolve_cluster("c:3") == ["c:3"]
    assert resolve_cluster(["c:3", "d:4"]) == ["c:3", "d:4"]
    assert resolve_cluster("gcache://y:8") == "gcache://y:8"
    clean_env.setenv("GCACHE_MASTERS", "m:1")
    assert resolve_cluster() == "gcache://m:1"
