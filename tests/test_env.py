"""One token and cluster resolution for every entry point (gcache.env)."""

import re

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


def test_a_token_that_cannot_be_a_grpc_header_is_a_clear_error(clean_env, tmp_path):
    """A token file of random bytes raised UnicodeDecodeError (a traceback); a token with a
    non-ASCII or control character reached gRPC, which refused the header, so every master
    looked down ("no master answered")."""
    from gcache import ClientConfig

    garbage, accented, ctrl = tmp_path / "garbage", tmp_path / "accented", tmp_path / "ctrl"
    garbage.write_bytes(bytes(range(128, 228)))
    accented.write_text("t\u00f6k\u00e9n\n")
    ctrl.write_text("a\x01b\n")
    with pytest.raises(ConfigError, match="is not text"):
        resolve_token(str(garbage))
    for path in (accented, ctrl):
        with pytest.raises(ConfigError, match="printable ASCII"):
            resolve_token(str(path))
    clean_env.setenv("GCACHE_TOKEN", "a\tb")
    with pytest.raises(ConfigError, match="GCACHE_TOKEN"):
        resolve_token()
    clean_env.setenv("GCACHE_TOKEN", "a b")  # an inner space is a valid header value: kept working
    assert resolve_token() == "a b"
    with pytest.raises(ConfigError, match="printable ASCII"):
        ClientConfig(token="t\u00f6k")
    assert ClientConfig(token="0123abcdef-_.~!").token == "0123abcdef-_.~!"


def test_master_lists_are_checked_entry_by_entry():
    """Before: a port that was not a number raised ValueError from deep inside (a traceback),
    99999 connected to port 34463, and http:// or a bad entry said only "Name or service not
    known"."""
    from gcache.meta.master_client import parse_masters

    assert parse_masters(" gcache://a:1 , [::1]:2/ ") == ["a:1", "[::1]:2"]
    for spec, why in [("gcache://127.0.0.1:abc", "127.0.0.1:abc"), ("gcache://127.0.0.1:99999", "99999"),
                      ("gcache://h:-1", "h:-1"), ("http://127.0.0.1:49885", "not http://"),
                      ("gcache://a:1,b c:2", "b c:2"), ("gcache://", "expected")]:
        with pytest.raises(ConfigError, match=re.escape(why)):
            parse_masters(spec)


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
