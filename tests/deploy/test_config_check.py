"""`gcache config check` refuses what the processes refuse (the systemd units run it as
ExecStartPre), each problem at its key's line; operator commands find the token and masters a
file gives only in [daemon]; the processes refuse the nonsense config check refuses.

Found by a deployment probe: config check said ok for a missing token file, pool budgets larger
than the arena, a wildcard Raft address, a master whose gRPC and Raft ports were one, ...; and
`gcache drain --config` (the daemon unit's ExecStop) ran with no token when the file gave it
only under [daemon]."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gcache import cli
from gcache.env import resolve_token
from gcache.ops.config import check_text

ROOT = Path(__file__).resolve().parents[2]
GCACHE = [sys.executable, "-m", "gcache"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = cli.build_parser()
    cli._apply_config(parser, argv)
    return parser.parse_args(argv)


def config_check(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["config", "check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def no_token_env(monkeypatch):
    monkeypatch.delenv("GCACHE_TOKEN", raising=False)
    monkeypatch.delenv("GCACHE_TOKEN_FILE", raising=False)
    monkeypatch.delenv("GCACHE_MASTERS", raising=False)
    monkeypatch.delenv("GCACHE_CONFIG", raising=False)


# -- M4: operator commands read [daemon]'s token_file and masters when [cluster] lacks them ----
def test_operator_commands_fall_back_to_the_daemon_section_for_token_and_masters(tmp_path, no_token_env):
    tok = tmp_path / "tok"
    tok.write_text("from-daemon\n")
    only_daemon = tmp_path / "d.toml"
    only_daemon.write_text(f'[daemon]\nnode_id = "n1"\ntoken_file = "{tok}"\nmasters = ["127.0.0.2:1"]\n')
    for cmd in ("status", "health", "drain"):
        a = parse([cmd, "--config", str(only_daemon)])
        assert a.token_file == str(tok), cmd
        assert resolve_token(a.token_file) == "from-daemon", cmd
        assert a.masters == "gcache://127.0.0.2:1", cmd
    # [cluster] wins over [daemon] for the operator commands; the daemon itself prefers its own section
    cluster_tok = tmp_path / "ctok"
    cluster_tok.write_text("from-cluster\n")
    both = tmp_path / "b.toml"
    both.write_text(f'[cluster]\ntoken_file = "{cluster_tok}"\nmasters = ["127.0.0.1:1"]\n'
                    f'[daemon]\ntoken_file = "{tok}"\nmasters = ["127.0.0.2:1"]\n')
    for cmd in ("status", "health", "drain"):
        a = parse([cmd, "--config", str(both)])
        assert (a.token_file, a.masters) == (str(cluster_tok), "gcache://127.0.0.1:1"), cmd
    d = parse(["daemon", "--config", str(both)])
    assert (d.token_file, d.masters) == (str(tok), "gcache://127.0.0.2:1")
    # a master list may begin with gcache:// (as --masters and $GCACHE_MASTERS), in either section
    url = tmp_path / "u.toml"
    url.write_text('[cluster]\nmasters = ["gcache://127.0.0.1:1", "127.0.0.1:2"]\n[daemon]\nmasters = "gcache://127.0.0.2:1"\n')
    assert parse(["status", "--config", str(url)]).masters == "gcache://127.0.0.1:1,127.0.0.1:2"
    assert parse(["daemon", "--config", str(url)]).masters == "gcache://127.0.0.2:1"


def test_token_precedence_is_flag_then_config_then_env_file_then_env_token(tmp_path, monkeypatch, no_token_env):
    toks = {}
    for n in ("cfg", "env", "flag"):
        toks[n] = tmp_path / f"tok_{n}"
        toks[n].write_text(f"from-{n}\n")
    c = tmp_path / "c.toml"
    c.write_text(f'[cluster]\nmasters = ["127.0.0.1:1"]\ntoken_file = "{toks["cfg"]}"\n')
    bare = tmp_path / "bare.toml"
    bare.write_text('[cluster]\nmasters = ["127.0.0.1:1"]\n')
    monkeypatch.setenv("GCACHE_TOKEN_FILE", str(toks["env"]))
    monkeypatch.setenv("GCACHE_TOKEN", "from-envtoken")
    for cmd in ("daemon", "status", "health", "drain"):
        assert resolve_token(parse([cmd, "--config", str(c), "--token-file", str(toks["flag"])]).token_file) \
            == "from-flag"
        assert resolve_token(parse([cmd, "--config", str(c)]).token_file) == "from-cfg"
        assert resolve_token(parse([cmd, "--config", str(bare)]).token_file) == "from-env"
    monkeypatch.delenv("GCACHE_TOKEN_FILE")
    assert resolve_token(parse(["status", "--config", str(bare)]).token_file) == "from-envtoken"
    doc = " ".join((ROOT / "docs" / "deploy.md").read_text().split())
    assert "Precedence" in doc
    assert "`--token-file`, then the config file" in doc and "then `$GCACHE_TOKEN_FILE`, then `$GCACHE_TOKEN`" in doc
