"""docs/deploy.md stays true: every gcache command it shows is one the CLI accepts (against the
example config), every file it names exists, and its ports table matches the configs."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

from gcache import cli

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "deploy.md").read_text()
EXAMPLE = ROOT / "deploy" / "gcache.toml"


def shell_lines() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", DOC, re.DOTALL)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if line.strip()]


def test_every_gcache_command_in_the_doc_parses():
    checked = 0
    for line in shell_lines():
        for part in re.split(r"&&|;|\buntil\b|\bdo\b|\bdone\b", line):
            argv = shlex.split(part.strip())
            if not argv:
                continue
            prog = argv[0].rsplit("/", 1)[-1]
            if prog != "gcache":
                continue
            args = [str(EXAMPLE) if a == "/etc/gcache/gcache.toml" else a for a in argv[1:]]
            if args[:2] == ["config", "check"]:
                args = ["config", "check", str(EXAMPLE)]
            parser = cli.build_parser()
            cli._apply_config(parser, args)
            try:
                parser.parse_args(args)
            except SystemExit as exc:
                if exc.code != 0:  # --version / --help exit 0
                    raise AssertionError(f"docs/deploy.md: `{part.strip()}` is refused") from None
            checked += 1
    assert checked >= 8


def test_files_the_doc_names_exist():
    named = set(re.findall(r"`?(deploy/[A-Za-z0-9_./@-]+|docs/[A-Za-z0-9_.-]+)", DOC))
    named = {n.rstrip(".`") for n in named if "*" not in n and not n.endswith("token.txt")}
    missing = [n for n in sorted(named) if not (ROOT / n).exists()]
    assert not missing, missing
    assert len(named) >= 8


def test_ports_table_matches_the_configs():
    table = {int(p) for p in re.findall(r"^\| (\d+)/tcp", DOC, re.MULTILINE)}
    cfg = tomllib.loads(EXAMPLE.read_text())
    used = {int(cfg["daemon"]["listen"].rsplit(":", 1)[1]), cfg["daemon"]["metrics_port"],
            int(cfg["master"]["listen"].rsplit(":", 1)[1]), int(cfg["master"]["raft"].rsplit(":", 1)[1]),
            cfg["master"]["metrics_port"], cfg["router"]["port"], int(cfg["router"]["redis"].rsplit(":", 1)[1][:4])}
    assert table == used, (table, used)
