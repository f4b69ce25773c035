"""One TOML file per host for the daemon, the master, the router and the SGLang adapter.

Sections (every key optional; see ``deploy/gcache.toml`` for an annotated example)::

    [cluster]  masters = ["h1:7300", ...]  token_file = "/etc/gcache/token"
    [daemon]   listen, node_id, mem, disk, disk_size, ... (the ``gcache daemon`` flags)
    [master]   id, listen, raft, peers, ... (the ``gcache master`` flags)
    [router]   host, port, policy, ... and [[router.workers]] tables
    [sglang]   nodes, namespace, timeout_s, ... (the adapter's extra_config keys)

A file's values become the defaults of the command's flags, so a flag given on the command
line wins. The environment carries only secrets and paths: ``$GCACHE_TOKEN`` (the token itself),
``$GCACHE_CONFIG`` / ``$GCACHE_TOKEN_FILE`` (where the files are); a value the file gives wins
over theirs. ``token_file`` and ``masters``: the daemon's and the master's own section first, then
[cluster]; the operator commands (status, drain, health) [cluster] first, then [daemon].

``check(path)`` returns every problem with its line and key; ``gcache config check FILE`` prints them.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import tomllib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from gcache.argtypes import LOG_LEVELS, seconds_error
from gcache.errors import ConfigError
from gcache.ops.tomlpos import key_lines, line_of, syntax_position

CONFIG_ENV = "GCACHE_CONFIG"
LEVELS = LOG_LEVELS


class Kind(enum.Enum):
    STR = "a string"
    PATH = "a path"
    INT = "an integer"
    PORT = "a port number (0-65535)"
    SECONDS = "a finite number of seconds > 0"
    NUMBER = "a number"
    BOOL = "true or false"
    SIZE = "a size such as 512MiB or 4GiB"
    ADDR = "HOST:PORT"
    ADDRS = "a list of HOST:PORT"
    STRS = "a list of strings"
    LEVEL = "a log level (" + ", ".join(LEVELS) + ")"
    WORKERS = "an array of [[router.workers]] tables"


@dataclass(frozen=True)
class Field:
    kind: Kind
    dest: str | None = None  # argparse destination it sets (None: same as the key)
    invert: bool = False  # a `true` here sets a --no-X flag to False
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Problem:
    line: int
    column: int
    key: str
    message: str

    def format(self, path: str) -> str:
        where = f"{path}:{self.line}" + (f":{self.column}" if self.column else "")
        return f"{where}: {self.key + ': ' if self.key else ''}{self.message}"


class ConfigFileError(ConfigError):
    def __init__(self, path: str, problems: list[Problem]) -> None:
        self.path, self.problems = path, problems
        super().__init__("\n".join(p.format(path) for p in problems))


SCHEMA: dict[str, dict[str, Field]] = {
    "cluster": {
        "masters": Field(Kind.ADDRS),
        "token_file": Field(Kind.PATH),
    },
    "daemon": {
        "listen": Field(Kind.ADDR), "node_id": Field(Kind.STR), "mem": Field(Kind.SIZE),
        "disk": Field(Kind.PATH), "disk_size": Field(Kind.SIZE), "max_value": Field(Kind.SIZE),
        "pool_budgets": Field(Kind.STRS, dest="pool_budget"), "pretouch": Field(Kind.BOOL, "no_pretouch", True),
        "masters": Field(Kind.ADDRS), "token_file": Field(Kind.PATH), "heartbeat": Field(Kind.SECONDS),
        "fence_after": Field(Kind.SECONDS), "metrics_port": Field(Kind.PORT), "metrics_host": Field(Kind.STR),
        "local": Field(Kind.BOOL, "no_local", True), "lease": Field(Kind.SECONDS), "ucx": Field(Kind.BOOL),
        "ready_file": Field(Kind.PATH), "log_level": Field(Kind.LEVEL),
        "advertise": Field(Kind.STR),  # HOST or HOST:PORT (gcache.daemon checks it)
    },
    "master": {
        "id": Field(Kind.STR), "listen": Field(Kind.ADDR), "raft": Field(Kind.ADDR), "peers": Field(Kind.ADDRS),
        "token_file": Field(Kind.PATH), "suspect_after": Field(Kind.SECONDS), "down_after": Field(Kind.SECONDS),
        "metrics_port": Field(Kind.PORT), "metrics_host": Field(Kind.STR), "ready_file": Field(Kind.PATH),
        "log_level": Field(Kind.LEVEL),
    },
    "router": {
        "host": Field(Kind.STR), "port": Field(Kind.PORT), "workers": Field(Kind.WORKERS, dest="worker"),
        "policy": Field(Kind.STR), "state": Field(Kind.STR, choices=("memory", "redis")),
        "redis": Field(Kind.STR), "namespace": Field(Kind.STR),
        "queue_order": Field(Kind.STR, choices=("fcfs", "uncached", "aged")), "aging": Field(Kind.SECONDS),
        "max_wait": Field(Kind.SECONDS), "max_queue": Field(Kind.INT), "buckets": Field(Kind.STR), "block_tokens": Field(Kind.INT),
        "page_size": Field(Kind.INT), "tokenizer": Field(Kind.PATH), "chat_template": Field(Kind.PATH),
        "l3_nodes": Field(Kind.STR), "l3_shard": Field(Kind.STR), "l3_namespace": Field(Kind.STR),
        "l3_timeout": Field(Kind.SECONDS), "inflight_penalty_ms": Field(Kind.NUMBER),
        "max_body_mb": Field(Kind.SECONDS), "health_interval": Field(Kind.SECONDS),
        "body_timeout": Field(Kind.SECONDS), "connect_timeout": Field(Kind.SECONDS),
        "first_byte_timeout": Field(Kind.SECONDS), "idle_timeout": Field(Kind.SECONDS), "retries": Field(Kind.INT),
        "breaker_failures": Field(Kind.INT), "breaker_open": Field(Kind.SECONDS),
        "admin_token_file": Field(Kind.PATH), "worker_header": Field(Kind.BOOL), "access_log": Field(Kind.BOOL),
        "log_level": Field(Kind.LEVEL),
    },
    "sglang": {
        "nodes": Field(Kind.ADDRS), "namespace": Field(Kind.STR), "timeout_s": Field(Kind.SECONDS),
        "connect_timeout_s": Field(Kind.SECONDS), "dual_pools": Field(Kind.BOOL), "skip_existing": Field(Kind.BOOL),
    },
}
WORKER_KEYS = {"url": Kind.STR, "bucket": Kind.INT, "role": Kind.STR, "max_inflight": Kind.INT}


def _addr_error(v: Any) -> str | None:
    if not isinstance(v, str):
        return f"expected HOST:PORT, got {v!r}"
    host, _, port = v.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"expected HOST:PORT, got {v!r}"
    return None


def _type_error(kind: Kind, v: Any) -> str | None:
    """Why ``v`` is not of ``kind`` (None when it is)."""
    from gcache.sizes import parse_size

    ok = {
        Kind.STR: isinstance(v, str) and bool(v), Kind.PATH: isinstance(v, str) and bool(v),
        Kind.INT: isinstance(v, int) and not isinstance(v, bool),
        Kind.PORT: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 65535,
        Kind.SECONDS: seconds_error(v) is None,  # finite and > 0, as the flags (gcache.argtypes)
        Kind.NUMBER: isinstance(v, (int, float)) and not isinstance(v, bool),
        Kind.BOOL: isinstance(v, bool),
        Kind.STRS: isinstance(v, list) and all(isinstance(x, str) for x in v),
        Kind.LEVEL: isinstance(v, str) and v.upper() in LEVELS,
        Kind.WORKERS: isinstance(v, list) and all(isinstance(x, dict) for x in v),
    }
    if kind is Kind.ADDR:
        return _addr_error(v)
    if kind is Kind.ADDRS:
        items = [x.strip() for x in v.split(",")] if isinstance(v, str) else v
        if not isinstance(items, list) or not items:
            return f"expected {kind.value}, got {v!r}"
        return next((e for e in map(_addr_error, items) if e), None)
    if kind is Kind.SIZE:
        try:
            parse_size(v)  # ConfigError for anything but a size string or an int >= 0
        except ConfigError:
            return f"expected {kind.value}, got {v!r}"
        return None
    return None if ok[kind] else f"expected {kind.value}, got {v!r}"


def _as_list(v: Any) -> list[str]:
    return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else list(v)


# -- cross-key checks: (section doc) -> [(key path, message)] --------------------------------
def _masters_problems(d: dict) -> list[tuple[tuple, str]]:
    """``masters`` as the commands read it (masters_url, then the master client's parse_masters)."""
    if "masters" not in d:
        return []
    from gcache.meta.master_client import parse_masters

    try:
        parse_masters(masters_url(d["masters"]))
    except ConfigError as exc:
        return [(("masters",), str(exc))]
    return []


def _check_cluster(d: dict, cluster: dict) -> list[tuple[tuple, str]]:
    return _masters_problems(d)


def _check_daemon(d: dict, cluster: dict) -> list[tuple[tuple, str]]:
    from gcache.sizes import parse_size
    from gcache.tier.pools import PoolBudget

    out = _masters_problems(d)
    mem = parse_size(d.get("mem", "1GiB")) if not _type_error(Kind.SIZE, d.get("mem", "1GiB")) else None
    for i, spec in enumerate(d.get("pool_budgets", []) if isinstance(d.get("pool_budgets"), list) else []):
        try:
            if mem is not None and isinstance(spec, str):
                PoolBudget.parse(spec, mem)
        except ConfigError as exc:
            out.append((("pool_budgets",), f"entry {i}: {exc}"))
    if "disk_size" in d and "disk" not in d:
        out.append((("disk_size",), "set without disk (the NVMe tier directory)"))
    return out


def _check_master(d: dict, cluster: dict) -> list[tuple[tuple, str]]:
    out = []
    peers = d.get("peers")
    if peers is not None and not _type_error(Kind.ADDRS, peers):
        peers = _as_list(peers)
        if len(peers) not in (1, 3, 5):
            out.append((("peers",), f"a Raft group has 1, 3 or 5 masters, this lists {len(peers)}"))
        if isinstance(d.get("raft"), str) and d["raft"] not in peers:
            out.append((("raft",), f"{d['raft']!r} is not among peers"))
    s, dn = d.get("suspect_after", 2.0), d.get("down_after", 3.0)
    if isinstance(s, (int, float)) and isinstance(dn, (int, float)) and not s < dn:
        out.append((("down_after",), f"must be greater than suspect_after ({s})"))
    return out


def _check_router(d: dict, cluster: dict) -> list[tuple[tuple, str]]:
    from router.config import BucketConfig, WorkerSpec

    out: list[tuple[tuple, str]] = []
    if isinstance(d.get("buckets"), str):
        try:
            BucketConfig.parse(d["buckets"])
        except ValueError as exc:
            out.append((("buckets",), str(exc)))
    if isinstance(d.get("policy"), str):
        known: Collection[str] | None
        try:
            from router.policies import POLICIES

            known = POLICIES
        except ImportError:  # the router extra is not installed: its names cannot be checked
            known = None
        if known is not None and d["policy"] not in known:
            out.append((("policy",), f"unknown policy {d['policy']!r}; one of {', '.join(sorted(known))}"))
    for i, w in enumerate(d.get("workers", []) if isinstance(d.get("workers"), list) else []):
        if not isinstance(w, dict):
            continue
        for k, v in w.items():
            if k not in WORKER_KEYS:
                out.append((("workers", i, k), f"unknown worker key; known: {', '.join(WORKER_KEYS)}"))
            elif e := _type_error(WORKER_KEYS[k], v):
                out.append((("workers", i, k), e))
        if "url" not in w:
            out.append((("workers", i), "a worker needs a url"))
            continue
        try:
            WorkerSpec.from_dict({k: v for k, v in w.items() if k in WORKER_KEYS})
        except ValueError as exc:
            out.append((("workers", i), str(exc)))
    return out


def _check_sglang(d: dict, cluster: dict) -> list[tuple[tuple, str]]:
    from sglang_adapter.config import AdapterConfig

    if "nodes" not in d:
        return []
    try:
        AdapterConfig.from_extra(d, read_file=False)
    except ConfigError as exc:
        return [((), str(exc))]
    return []


CHECKS: dict[str, Callable[[dict, dict], list[tuple[tuple, str]]]] = {
    "cluster": _check_cluster, "daemon": _check_daemon, "master": _check_master, "router": _check_router, "sglang": _check_sglang,
}


# A command's own check of its section: given the whole document, (argparse dest or None, problem)
# for each value the command would refuse. ``gcache config check`` passes the daemon's and the
# master's (gcache.daemon, gcache.masterd: a layer above this module) and a check of the token
# files, so the file is refused for what the processes themselves refuse.
Validator = Callable[[dict], list[tuple[str | None, str]]]


def check_text(text: str, validators: dict[str, Validator] | None = None) -> tuple[dict, list[Problem]]:
    """Parse and validate; returns the document and every problem found (syntax errors stop it).
    ``validators`` (section -> Validator) run on a section that has no problem of its own."""
    if text.startswith("\ufeff"):  # tomllib's word for it: "Invalid statement (at line 1, column 1)"
        return {}, [Problem(1, 1, "", "the file begins with a byte order mark (BOM, U+FEFF); TOML files must not: "
                                      "save it as UTF-8 without a BOM")]
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line, col = syntax_position(str(exc))
        return {}, [Problem(line, col, "", f"TOML syntax error: {exc}")]
    except RecursionError:  # arrays or tables nested thousands deep: no config is like that
        return {}, [Problem(1, 1, "", "TOML nested too deeply to read")]
    lines = key_lines(text)
    problems: list[tuple[tuple, str]] = []
    for section, body in doc.items():
        if section not in SCHEMA:
            problems.append(((section,), f"unknown section; known: {', '.join(SCHEMA)}"))
            continue
        if not isinstance(body, dict):
            problems.append(((section,), "must be a table ([" + section + "])"))
            continue
        typed_ok = {}
        for key, value in body.items():
            field = SCHEMA[section].get(key)
            if field is None:
                problems.append(((section, key), f"unknown key; known in [{section}]: {', '.join(SCHEMA[section])}"))
            elif err := _type_error(field.kind, value):
                problems.append(((section, key), err))
            elif field.choices and value not in field.choices:
                problems.append(((section, key), f"one of {', '.join(field.choices)}, got {value!r}"))
            else:
                typed_ok[key] = value
        found = len(problems)
        if section in CHECKS:
            problems += [((section, *p), m) for p, m in CHECKS[section](typed_ok, doc.get("cluster", {}))]
        if validators and section in validators and len(problems) == found and len(typed_ok) == len(body):
            keys = {(f.dest or k): k for k, f in SCHEMA[section].items()}
            problems += [((section, keys[dest]) if dest in keys else (section,), msg)
                         for dest, msg in validators[section](doc)]
    out = []
    for path, msg in problems:
        key = path[0] if len(path) == 1 else f"[{path[0]}] " + ".".join(
            f"[{p}]" if isinstance(p, int) else str(p) for p in path[1:])
        key = key.replace(".[", "[").replace("] [", "] ")
        out.append(Problem(_line(lines, path), 0, key, msg))
    out.sort(key=lambda p: p.line)
    return doc, out


def _line(lines: dict[tuple, int], path: tuple) -> int:
    if len(path) >= 2 and path[1] == "workers" and len(path) >= 3 and isinstance(path[2], int):
        # [[router.workers]] tables are keyed ("router", "workers", i, key); inline arrays are not
        return line_of(lines, (f"{path[0]}", "workers", *path[2:])) if (path[0], "workers", path[2]) in lines \
            else line_of(lines, path[:2])
    return line_of(lines, path)


def _read(path: str) -> str:
    """The file's text; ConfigError (naming the file) when it cannot be read or is not UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path!r}: {exc}") from None
    except UnicodeDecodeError as exc:  # TOML is UTF-8
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
                          f"{exc.start}); TOML files must be UTF-8") from None


def check(path: str, validators: dict[str, Validator] | None = None) -> list[Problem]:
    try:
        text = _read(path)
    except ConfigError as exc:
        return [Problem(0, 0, "", str(exc))]
    return check_text(text, validators)[1]


def load(path: str) -> dict:
    """The validated document, or ConfigError naming the file (it cannot be read, or is not
    UTF-8) or ConfigFileError naming every problem with its line."""
    text = _read(path)
    doc, problems = check_text(text)
    if problems:
        raise ConfigFileError(path, problems)
    return doc


# -- turning a section into flag defaults ---------------------------------------------------
def _arg_value(field: Field, value: Any) -> Any:
    if field.invert:
        return not value
    if field.kind is Kind.ADDRS:
        return ",".join(_as_list(value))
    if field.kind is Kind.WORKERS:
        return [",".join([w["url"], *(f"{k}={w[k]}" for k in ("bucket", "role", "max_inflight") if k in w)])
                for w in value]
    if field.kind is Kind.SIZE:
        return str(value)
    return value


def masters_url(value: Any) -> str:
    """A file's ``masters`` (a list of HOST:PORT, or one comma-separated string) as the
    ``gcache://`` URL the commands take; the list may begin with ``gcache://``, as --masters and
    $GCACHE_MASTERS may."""
    return "gcache://" + ",".join(_as_list(value)).removeprefix("gcache://")


def defaults_for(doc: dict, command: str) -> dict[str, Any]:
    """argparse defaults (dest -> value) that ``doc`` gives ``command``."""
    out: dict[str, Any] = {}
    cluster = doc.get("cluster", {})
    if command in ("daemon", "status", "drain", "health"):
        # [cluster] first; the operator commands fall back to [daemon]'s (the daemon's own section
        # overrides [cluster] below): `gcache drain --config` stops a daemon with the daemon's token
        fallback = doc.get("daemon", {}) if command != "daemon" else {}
        for key in ("masters", "token_file"):
            src = cluster if key in cluster else fallback
            if key in src:
                out[key] = masters_url(src[key]) if key == "masters" else src[key]
    if command == "master" and "token_file" in cluster:
        out["token_file"] = cluster["token_file"]
    section = None if command in ("status", "drain", "health") else command  # these have no section
    fields = SCHEMA.get(section, {}) if section else {}
    for key, value in (doc.get(section, {}) if section else {}).items():
        field = fields[key]
        dest = field.dest or key
        out[dest] = masters_url(value) if dest == "masters" else _arg_value(field, value)
    daemon = doc.get("daemon", {})
    if command == "drain" and ("node_id" in daemon or "listen" in daemon or "advertise" in daemon):
        out["node"] = daemon.get("node_id") or _default_node_id(daemon)
    if command == "health" and "metrics_port" in doc.get("daemon", {}):
        host = doc["daemon"].get("metrics_host", "127.0.0.1")
        out["daemon_metrics"] = f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{doc['daemon']['metrics_port']}"
    return out


def _default_node_id(daemon: dict) -> str:
    """The node id of a daemon without node_id: its advertised address, else its listen address."""
    from gcache.net.address import parse_advertise

    listen = str(daemon.get("listen", "127.0.0.1:7400"))
    try:
        return parse_advertise(daemon["advertise"], int(listen.rpartition(":")[2])) if "advertise" in daemon else listen
    except ValueError:
        return listen


def apply_defaults(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Make ``defaults`` the parser's defaults; an option they fill is no longer required."""
    known = {a.dest for a in parser._actions} | set(parser._defaults)
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False
    parser.set_defaults(**{k: v for k, v in defaults.items() if k in known})


def config_path(argv: list[str]) -> str | None:
    """``--config FILE`` from argv, else $GCACHE_CONFIG."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return os.environ.get(CONFIG_ENV) or None


def level(name: str) -> int:
    return logging.getLevelName(name.upper())
