"""deploy/systemd: the units pass ``systemd-analyze verify`` with no warning, score OK on its
offline security check, carry the limits a data plane needs, and their command lines are ones
gcache accepts (run against the example config)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gcache import cli, env

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
EXAMPLE = ROOT / "deploy" / "gcache.toml"
PREFIX = "/opt/gcache/venv/bin/"
NAMES = ("gcached@.service", "gcache-master.service", "gcache-router.service")


def unit(name: str) -> dict[str, list[str]]:
    """Section.Key -> values (systemd keys repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        k, _, v = line.partition("=")
        out.setdefault(f"{section}.{k}", []).append(v)
    return out


def bin_dir() -> Path:
    here = Path(sys.executable).parent
    if (here / "gcache").exists() and (here / "gcache-router").exists():
        return here
    found = shutil.which("gcache")
    if not found:
        pytest.skip("the gcache entry points are not installed (pip install -e .)")
    return Path(found).parent


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("units")
    for name in NAMES:
        text = (UNITS / name).read_text().replace(PREFIX, f"{bin_dir()}/")
        (out / name).write_text(text)
    shutil.copy(out / "gcached@.service", out / "gcached@gpu-a.service")
    return out


def analyze(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (make test installs Debian's systemd package)")
    return subprocess.run(["systemd-analyze", *args], check=False, capture_output=True, text=True, timeout=60)


def test_units_verify_without_a_warning(rendered):
    files = [str(rendered / n) for n in ("gcached@gpu-a.service", "gcache-master.service", "gcache-router.service")]
    p = analyze("verify", *files)
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), p.stdout + p.stderr


def test_verify_catches_a_broken_unit(rendered):
    bad = rendered / "broken.service"
    bad.write_text((rendered / "gcache-master.service").read_text().replace("LimitNOFILE=65536",
                                                                           "LimitNOFILE=lots\nRestartt=always"))
    p = analyze("verify", str(bad))
    assert "lots" in p.stderr and "Restartt" in p.stderr


@pytest.mark.parametrize("name", ["gcached@gpu-a.service", "gcache-master.service", "gcache-router.service"])
def test_hardening_scores_ok(rendered, name):
    p = analyze("security", "--offline=true", "--no-pager", "--threshold=45", str(rendered / name))
    if "Unknown option" in p.stderr or "unrecognized option" in p.stderr:
        pytest.skip(f"this systemd-analyze has no offline security check: {p.stderr.strip()}")
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr


def test_data_plane_limits_and_what_must_stay_off():
    d = unit("gcached@.service")
    assert d["Service.LimitMEMLOCK"] == ["infinity"] and int(d["Service.LimitNOFILE"][0]) >= 65536
    assert d["Service.Restart"] == ["always"] and d["Service.NoNewPrivileges"] == ["yes"]
    assert d["Service.ProtectSystem"] == ["strict"] and d["Service.PrivateTmp"] == ["yes"]
    assert "AF_UNIX" in d["Service.RestrictAddressFamilies"][0]  # the local shared-memory path
    for off in ("PrivateNetwork", "PrivateDevices", "MemoryDenyWriteExecute", "PrivateUsers"):
        assert f"Service.{off}" not in d, f"{off} breaks the abstract Unix socket, GPU/RDMA devices or UCX"
    for name in NAMES:
        u = unit(name)
        assert u["Service.Restart"] == ["always"] and "Service.LimitNOFILE" in u and u["Install.WantedBy"]


def commands(name: str) -> list[list[str]]:
    u = unit(name)
    out = []
    for key in ("Service.ExecStartPre", "Service.ExecStart", "Service.ExecStop"):
        for line in u.get(key, []):
            argv = shlex.split(line.lstrip("-"))
            assert argv[0].startswith(PREFIX), line
            out.append([a.replace("/etc/gcache/%i.toml", str(EXAMPLE)).replace("/etc/gcache/gcache.toml", str(EXAMPLE))
                        for a in [argv[0][len(PREFIX):], *argv[1:]]])
    return out


def test_unit_command_lines_are_accepted(monkeypatch):
    import router.cli as rcli

    seen = []
    monkeypatch.setattr(rcli, "serve", lambda a: seen.append(a) or 0)
    def token_there(path: str) -> str:  # the units run on a host with the token file the config names
        assert path == "/etc/gcache/token", path
        return "t0ken"

    monkeypatch.setattr(env, "read_token_file", token_there)  # (config check reads it)
    checked = 0
    for name in NAMES:
        for argv in commands(name):
            prog, args = argv[0], argv[1:]
            if prog == "gcache-router":
                assert rcli.main(args) == 0 and seen[-1].host == "10.0.0.11"
            elif args[:2] == ["config", "check"]:
                assert cli.main(args) == 0
            else:
                parser = cli.build_parser()
                cli._apply_config(parser, args)
                a = parser.parse_args(args)
                if a.cmd == "drain":
                    assert a.node == "gpu-a" and a.timeout == 240
                if a.cmd == "master":
                    assert a.raft == "10.0.0.11:7310"
            checked += 1
    assert checked == 7  # 3 ExecStartPre, 3 ExecStart, the daemon's draining ExecStop
    sysusers = (UNITS / "gcache.sysusers.conf").read_text()
    assert any(line.startswith("u gcache ") for line in sysusers.splitlines())
