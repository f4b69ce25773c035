"""The TOML config file: schema errors name line and key, flags override the file, every
consumer (daemon, master, status/health, router, SGLang adapter) reads its section."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gcache import cli
from gcache.ops.config import check, check_text, defaults_for, load
from tests.conftest import poll

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "gcache.toml"
GCACHE = [sys.executable, "-m", "gcache"]

BAD = textwrap.dedent("""\
    [cluster]
    masters = ["h1:7300", "nohost"]

    [daemon]
    listen = "10.0.0.1:7400"
    mem = "lots"
    pretouch = "yes"
    bogus = 1
    pool_budgets = ["kv=175%"]

    [master]
    raft = "h:1"
    peers = ["a:1", "b:2"]
    suspect_after = 3
    down_after = 2

    [router]
    policy = "nope"
    [[router.workers]]
    url = "http://w:1"
    [[router.workers]]
    url = "ftp://x"
    colour = "red"

    [sglang]
    timeout_s = -1

    [extra]
    x = 1
    """)


def parse(argv: list[str]):
    parser = cli.build_parser()
    cli._apply_config(parser, argv)
    return parser.parse_args(argv)


def test_example_config_is_valid_and_covers_every_section(tmp_path):
    doc = load(str(EXAMPLE))
    assert set(doc) == {"cluster", "daemon", "master", "router", "sglang"}
    token = tmp_path / "token"  # config check reads the token file: as on a host that has it
    token.write_text("t0ken\n")
    conf = tmp_path / "gcache.toml"
    conf.write_text(EXAMPLE.read_text().replace("/etc/gcache/token", str(token)))
    p = subprocess.run([*GCACHE, "config", "check", str(conf)], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr


def test_every_schema_error_names_its_line_and_key():
    _, problems = check_text(BAD)
    got = {(p.line, p.key) for p in problems}
    assert got == {
        (2, "[cluster] masters"), (6, "[daemon] mem"), (7, "[daemon] pretouch"), (8, "[daemon] bogus"),
        (9, "[daemon] pool_budgets"), (12, "[master] raft"), (13, "[master] peers"), (15, "[master] down_after"),
        (18, "[router] policy"), (21, "[router] workers[1]"), (23, "[router] workers[1].colour"),
        (26, "[sglang] timeout_s"), (28, "extra"),
    }, "\n".join(p.format("x") for p in problems)
    assert all(p.message for p in problems)


def test_config_check_command_prints_file_line_key(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(BAD)
    good = tmp_path / "good.toml"
    good.write_text('[daemon]\nmem = "1GiB"\n')
    p = subprocess.run([*GCACHE, "config", "check", str(good), str(bad)], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1
    assert f"{good}: ok" in p.stdout
    assert f"{bad}:6: [daemon] mem: expected a size" in p.stderr
    assert f"{bad}:8: [daemon] bogus: unknown key" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 13


def test_syntax_error_gives_line_and_column(tmp_path):
    f = tmp_path / "syntax.toml"
    f.write_text('[daemon]\nmem = "1GiB\nlisten = 3\n')
    (prob,) = check(str(f))
    assert (prob.line, prob.column) == (2, 12) and "syntax" in prob.message
    missing = check(str(tmp_path / "absent.toml"))
    assert len(missing) == 1 and "cannot read" in missing[0].message


def test_a_config_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path, capsys, monkeypatch):
    """A config file with a byte that is not UTF-8 (a Latin-1 editor, a binary file named by
    mistake) raised UnicodeDecodeError out of load(): a traceback from `gcache daemon --config`,
    the router and the SGLang adapter. It is a ConfigError that names the file now."""
    from gcache.errors import ConfigError
    from sglang_adapter.config import AdapterConfig

    f = tmp_path / "latin1.toml"
    f.write_bytes('[daemon]\nnode_id = "caf\u00e9"\n'.encode("latin-1"))
    says = f"config file {str(f)!r} is not UTF-8 text (byte 0xe9 at offset 23)"
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(byte 0xe9 at offset 23\)") as err:
        load(str(f))
    assert str(f) in str(err.value)
    assert cli.main(["daemon", "--config", str(f)]) == 2
    assert says in capsys.readouterr().err
    (prob,) = check(str(f))
    assert says in prob.message
    monkeypatch.setenv("GCACHE_CONFIG", str(f))
    with pytest.raises(ConfigError, match="not UTF-8"):
        AdapterConfig.from_extra({})
    p = subprocess.run([*GCACHE, "status"], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_flags_override_the_file_and_file_overrides_defaults(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text(textwrap.dedent("""\
        [cluster]
        masters = ["127.0.0.1:7300", "127.0.0.1:7301"]
        token_file = "/etc/gcache/token"
        [daemon]
        listen = "127.0.0.1:7999"
        mem = "2GiB"
        pretouch = false
        pool_budgets = ["kv=50%"]
        [master]
        raft = "127.0.0.1:7310"
        peers = "127.0.0.1:7310"
        """))
    a = parse(["daemon", "--config", str(f), "--mem", "3GiB"])
    assert a.mem == "3GiB" and a.listen == "127.0.0.1:7999" and a.no_pretouch is True
    assert a.masters == "gcache://127.0.0.1:7300,127.0.0.1:7301" and a.token_file == "/etc/gcache/token"
    assert a.pool_budget == ["kv=50%"] and a.disk_size == "10GiB"  # untouched default
    # --raft and --peers are required flags; the file satisfies them
    m = parse(["master", "--config", str(f), "--suspect-after", "1.5"])
    assert (m.raft, m.peers, m.suspect_after, m.token_file) == ("127.0.0.1:7310", "127.0.0.1:7310", 1.5,
                                                                "/etc/gcache/token")
    s = parse(["status", "--config", str(f)])
    assert s.masters.startswith("gcache://127.0.0.1:7300")


def test_gcache_config_env_is_a_path(tmp_path, monkeypatch):
    f = tmp_path / "g.toml"
    f.write_text('[daemon]\nmem = "5GiB"\n')
    monkeypatch.setenv("GCACHE_CONFIG", str(f))
    assert parse(["daemon"]).mem == "5GiB"
    assert parse(["put", "k", "v"]).key == "k"  # commands without a section ignore it
    f.write_text('[daemon]\nmem = "many"\n')
    assert cli.main(["daemon"]) == 2


def test_daemon_runs_from_the_file(tmp_path):
    ready = tmp_path / "ready"
    f = tmp_path / "g.toml"
    f.write_text(textwrap.dedent(f"""\
        [daemon]
        listen = "127.0.0.1:0"
        node_id = "from-file"
        mem = "16MiB"
        pretouch = false
        local = false
        ready_file = "{ready}"
        """))
    proc = subprocess.Popen([*GCACHE, "daemon", "--config", str(f), "--mem", "8MiB"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert poll(lambda: ready.exists() or proc.poll() is not None, 30), "daemon not ready"
        assert proc.poll() is None, proc.stderr.read()
        line = proc.stdout.readline()
        assert "node=from-file" in line and f"mem={8 << 20}" in line, line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_router_reads_its_section(tmp_path, monkeypatch):
    pytest.importorskip("aiohttp", reason="router extra not installed")
    import router.cli as rcli

    seen = []
    monkeypatch.setattr(rcli, "serve", lambda a: seen.append(a) or 0)
    assert rcli.main(["serve", "--config", str(EXAMPLE), "--port", "0", "--worker", "http://extra:1"]) == 0
    (a,) = seen
    cfg, workers = rcli.config_from_args(a)
    assert a.port == 0 and a.host == "10.0.0.11" and a.config is None
    assert cfg.state.value == "redis" and cfg.redis_url == "redis://10.0.0.11:6379/0"
    assert [(w.url, w.bucket, w.max_inflight) for w in workers] == [
        ("http://10.0.0.11:30000", 0, 64), ("http://10.0.0.12:30000", 1, 64), ("http://10.0.0.13:30000", None, 64),
        ("http://extra:1", None, 64)]
    bad = tmp_path / "r.toml"
    bad.write_text('[router]\nport = "eighty"\n')
    assert rcli.main(["serve", "--config", str(bad)]) == 2


def test_sglang_adapter_reads_its_section(tmp_path, monkeypatch):
    from sglang_adapter.config import AdapterConfig

    c = AdapterConfig.from_extra({"config": str(EXAMPLE), "timeout_s": 2.5})
    assert c.nodes == ("10.0.0.11:7400", "10.0.0.12:7400", "10.0.0.13:7400")
    assert c.namespace == "llama-70b" and c.timeout_s == 2.5
    monkeypatch.setenv("GCACHE_CONFIG", str(EXAMPLE))
    assert AdapterConfig.from_extra({}).namespace == "llama-70b"


def test_health_defaults_come_from_the_file():
    d = defaults_for(load(str(EXAMPLE)), "health")
    assert d["daemon_metrics"] == "10.0.0.11:9400"
    assert d["masters"] == "gcache://10.0.0.11:7300,10.0.0.12:7300,10.0.0.13:7300"
    a = parse(["health", "--config", str(EXAMPLE)])  # and reach the parsed arguments
    assert a.daemon_metrics == "10.0.0.11:9400" and a.masters.startswith("gcache://10.0.0.11:7300")
