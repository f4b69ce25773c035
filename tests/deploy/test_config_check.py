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
from gcache.ops.config import SCHEMA, check_text

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


# -- M5: config check refuses what the processes refuse, at the key's line --------------------
CASES = {
    # name: (file text, expected "LINE: KEY: fragment")
    "token_missing": ('[cluster]\ntoken_file = "/nonexistent/token"\n',
                      "2: [cluster] token_file: cannot read token file '/nonexistent/token'"),
    "token_empty": ('[daemon]\ntoken_file = "{empty}"\n', "2: [daemon] token_file: token file"),
    "pool_sum": ('[daemon]\nmem = "64MiB"\npool_budgets = ["kv=75%", "swa=75%"]\n',
                 "3: [daemon] pool_budgets: pool budgets"),
    "pool_over": ('[daemon]\nmem = "1GiB"\npool_budgets = ["kv=2GiB"]\n',
                  "3: [daemon] pool_budgets: pool budgets {'kv': 2147483648} add up to more than the arena"),
    "master_noraft": ('[cluster]\ntoken_file = "{tok}"\n[master]\nid = "m1"\n', "3: [master] raft: missing"),
    "master_wild": ('[master]\nraft = "0.0.0.0:7310"\npeers = ["0.0.0.0:7310"]\n',
                    "2: [master] raft: Raft address '0.0.0.0:7310': bind an explicit address, not a wildcard"),
    "masters_url": ('[cluster]\nmasters = ["gcache://h:1", "gcache://h:2"]\n', "2: [cluster] masters: "),
    "master_samelisten": ('[master]\nlisten = "127.0.0.1:7310"\nraft = "127.0.0.1:7310"\npeers = ["127.0.0.1:7310"]\n',
                          "3: [master] raft: "),
    "daemon_same_ports": ('[daemon]\nlisten = "127.0.0.1:7400"\nmetrics_port = 7400\nmetrics_host = "127.0.0.1"\n',
                          "3: [daemon] metrics_port: "),
    "hb_huge": ("[daemon]\nheartbeat = 1e300\nfence_after = 1e301\n", "2: [daemon] heartbeat: "),
    "master_id_space": ('[master]\nid = "m 1"\nraft = "127.0.0.1:7310"\npeers = ["127.0.0.1:7310"]\n',
                        "2: [master] id: "),
    "peers_dup": ('[master]\nraft = "127.0.0.1:7310"\npeers = ["127.0.0.1:7310", "127.0.0.1:7310", "127.0.0.1:7311"]\n',
                  "3: [master] peers: "),
    "nodeid_space": ('[daemon]\nmem = "64MiB"\nnode_id = "a b"\n', "3: [daemon] node_id: "),
}


def test_config_check_refuses_what_the_processes_refuse_at_the_key(tmp_path, capsys, no_token_env):
    (tmp_path / "empty").write_text("")
    (tmp_path / "tok").write_text("t0ken\n")
    for name, (text, says) in CASES.items():
        f = tmp_path / f"{name}.toml"
        f.write_text(text.replace("{empty}", str(tmp_path / "empty")).replace("{tok}", str(tmp_path / "tok")))
        code, out, err = config_check(capsys, str(f))
        assert code == 1 and f"{f}:{says}" in err, (name, err, out)
        assert "Traceback" not in err and len(err.strip().splitlines()) == (2 if name == "master_noraft" else 1), \
            (name, err)
        if name == "master_noraft":
            assert f"{f}:3: [master] peers: missing: gcache master needs it (--peers)" in err


def test_a_shared_config_need_not_hold_per_host_flags_nor_a_readable_token(capsys, no_token_env):
    """A Kubernetes ConfigMap leaves a master's raft to its pod's flags and mounts the token from
    a Secret: --shared checks it without either."""
    for overlay in ("dev", "gpu", "rdma"):
        f = ROOT / "deploy" / "k8s" / "overlays" / overlay / "gcache.toml"
        code, _, err = config_check(capsys, str(f))
        assert code == 1 and "[cluster] token_file: cannot read token file" in err and "[master] raft: missing" in err
        assert config_check(capsys, "--shared", str(f))[0] == 0, overlay


def test_the_example_is_ok_where_its_token_file_is(tmp_path, capsys, no_token_env):
    example = (ROOT / "deploy" / "gcache.toml").read_text()
    code, _, err = config_check(capsys, str(ROOT / "deploy" / "gcache.toml"))  # no /etc/gcache/token here
    says = (f"{ROOT / 'deploy' / 'gcache.toml'}:16: [cluster] token_file: cannot read token file "
            "'/etc/gcache/token': [Errno 2] No such file or directory: '/etc/gcache/token'")
    assert code == 1 and err.strip().splitlines() == [says], err
    tok = tmp_path / "token"
    tok.write_text("t0ken\n")
    f = tmp_path / "gcache.toml"
    f.write_text(example.replace("/etc/gcache/token", str(tok)))
    assert config_check(capsys, str(f))[0] == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_processes_refuse_what_they_accepted(tmp_path, no_token_env):
    """Each is refused before anything starts (a master whose gRPC and Raft ports were one, or
    whose id had a space, served; a daemon with a 1e300 s heartbeat registered and never beat)."""
    tok = tmp_path / "tok"
    tok.write_text("t0ken\n")
    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    runs = [
        (["master", "--token-file", str(tok), "--listen", a, "--raft", a, "--peers", a], "--raft"),
        (["master", "--token-file", str(tok), "--listen", b, "--id", "m 1", "--raft", a, "--peers", a], "--id"),
        (["master", "--token-file", str(tok), "--listen", b, "--raft", a, "--peers", f"{a},{a},127.0.0.1:1"], "twice"),
        (["master", "--token-file", str(tok), "--listen", b, "--raft", "0.0.0.0:7310", "--peers", "0.0.0.0:7310"],
         "wildcard"),
        (["daemon", "--listen", a, "--heartbeat", "1e300", "--fence-after", "1e301", "--masters", "gcache://" + b,
          "--mem", "1MiB", "--no-pretouch"], "--heartbeat"),
        (["daemon", "--listen", a, "--heartbeat", "3", "--mem", "1MiB", "--no-pretouch"],
         "--heartbeat: must be below --fence-after"),
        (["daemon", "--listen", a, "--metrics-port", a.rsplit(":", 1)[1], "--mem", "1MiB", "--no-pretouch"],
         "--metrics-port"),
    ]
    for argv, says in runs:
        try:
            p = subprocess.run([*GCACHE, *argv], capture_output=True, text=True, timeout=30, check=False)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{argv}: still running after 30 s (it should refuse to start)") from None
        assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, (argv, p.stderr)


# -- M6: the daemon's fence-after against the masters' down-after ------------------------------
def test_fence_after_must_leave_room_below_down_after(tmp_path, capsys, no_token_env):
    f = tmp_path / "f.toml"
    f.write_text(textwrap.dedent("""\
        [daemon]
        fence_after = 10.0
        [master]
        raft = "127.0.0.1:7310"
        peers = ["127.0.0.1:7310"]
        down_after = 3.0
        """))
    code, _, err = config_check(capsys, str(f))
    assert code == 1 and f"{f}:2: [daemon] fence_after: " in err and "down_after" in err, err
    f.write_text('[daemon]\nfence_after = 2.4\n[master]\nraft = "127.0.0.1:7310"\npeers = ["127.0.0.1:7310"]\n')
    code, _, err = config_check(capsys, str(f))  # 2.4 + 0.6 is not below the default down_after, 3.0
    assert code == 1 and f"{f}:2: [daemon] fence_after: " in err, err
    f.write_text('[daemon]\nfence_after = 2.3\n[master]\nraft = "127.0.0.1:7310"\npeers = ["127.0.0.1:7310"]\n')
    assert config_check(capsys, str(f))[0] == 0
    f.write_text('[daemon]\nfence_after = 2.3\n[master]\nraft = "127.0.0.1:7310"\nbogus = 1\n')
    code, _, err = config_check(capsys, str(f))  # (a [master] with problems of its own: those alone)
    assert code == 1 and err == f"{f}:5: [master] bogus: unknown key; known in [master]: " + ", ".join(
        SCHEMA["master"]) + "\n", err
    f.write_text("[daemon]\nheartbeat = 2.0\nfence_after = 2.0\n")
    code, _, err = config_check(capsys, str(f))
    assert code == 1 and f"{f}:2: [daemon] heartbeat: must be below --fence-after" in err, err


# -- LOW ---------------------------------------------------------------------------------------
def test_a_byte_order_mark_is_named(tmp_path, capsys):
    _, (prob,) = check_text("\ufeff[daemon]\nmem = \"64MiB\"\n")
    assert prob.line == 1 and "byte order mark" in prob.message, prob.message
    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf[daemon]\n")
    assert cli.main(["daemon", "--config", str(f)]) == 2
    assert "byte order mark" in capsys.readouterr().err


def test_help_says_what_the_flags_do(capsys):
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd").choices
    daemon_help = sub["daemon"].format_help()
    assert "127.0.0.1:PORT" not in daemon_help and "METRICS_HOST:PORT" in daemon_help
    clear_help = " ".join(sub["clear"].format_help().split())
    assert "say what would be deleted" not in clear_help and "refuse" in clear_help
    assert cli.main(["clear", "-n", "ns", "--nodes", "127.0.0.1:1"]) == 2
    assert "add --yes" in capsys.readouterr().err
