"""The ``gcache`` command: daemon, local cluster, data commands and the benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from typing import NoReturn

from gcache import argtypes
from gcache.errors import GCacheError, ServerError
from gcache.protocol import DEFAULT_MAX_VALUE_BYTES, ErrorCode

DEFAULT_NODES_HELP = "comma-separated HOST:PORT of the daemons (a static cluster; else $GCACHE_NODES)"
MASTERS_HELP = "gcache://HOST:PORT,... of the master group (else $GCACHE_MASTERS)"
TOKEN_FILE_HELP = "cluster token file (else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN)"
AUTH_HINT = "give the cluster token with --token-file FILE or $GCACHE_TOKEN_FILE (else $GCACHE_TOKEN)"
AUTH_REFUSED = f"(code {int(ErrorCode.AUTH)})"  # how a daemon's refusal of the token ends (ServerError)
# commands that read a TOML config file (gcache.ops.config)
CONFIG_COMMANDS = ("daemon", "master", "status", "drain", "health")


def _client(args: argparse.Namespace):
    from gcache.client import Client
    from gcache.env import resolve_cluster, resolve_token

    try:
        target = resolve_cluster(args.nodes, args.masters)
    except GCacheError as exc:
        raise SystemExit(f"gcache {args.cmd}: {exc}") from None
    return Client(target, namespace=args.namespace, timeout_s=args.timeout, token=resolve_token(args.token_file))


def cmd_up(args: argparse.Namespace) -> int:
    from gcache.cluster import LocalCluster
    from gcache.process import stop_on_signals

    if args.nodes_count == 0 and not args.masters:
        print("gcache up: --nodes must be >= 1 (0 only with --masters: a master group alone)", file=sys.stderr)
        return 2
    cluster = LocalCluster(nodes=args.nodes_count, mem=args.mem, disk=args.disk_size if args.disk else None,
                           root=args.dir, masters=args.masters)
    stop = stop_on_signals()
    try:
        cluster.start()
    except GCacheError as exc:
        cluster.stop()
        print(f"gcache up: {exc}", file=sys.stderr)
        return 1
    print(f"gcache: {len(cluster.daemons)} daemons up (data in {cluster.root}); Ctrl-C stops them"
          + ("" if args.no_restart else "; a process that dies is restarted"))
    for d in cluster.daemons:
        print(f"  {d.node_id}  {d.address}  pid {d.pid}")
    if cluster.master_procs:
        for m in cluster.master_procs:
            print(f"  master {m.node_id}  {m.address}  pid {m.pid}")
        print(f"export GCACHE_MASTERS={cluster.master_url}")
        print(f"export GCACHE_TOKEN_FILE={cluster.token_file}")
    print(f"export GCACHE_NODES={','.join(cluster.addresses)}", flush=True)
    code = 0
    try:
        while not stop.wait(0.2):
            if args.no_restart:
                dead = cluster.exited()
                if dead:
                    print(f"gcache up: {dead[0].label} exited; stopping", file=sys.stderr)
                    code = 1
                    break
                continue
            for event in cluster.supervise_once():
                print(f"gcache up: {event}", flush=True)
        return code
    finally:
        print("gcache: what ran:\n" + cluster.summary(), flush=True)
        cluster.stop()
        print("gcache: cluster stopped", flush=True)


def _master_client(args: argparse.Namespace):
    import os

    from gcache.env import MASTERS_ENV, resolve_token
    from gcache.meta.master_client import MasterClient

    url = args.masters or os.environ.get(MASTERS_ENV)
    if not url:
        raise SystemExit(f"gcache {args.cmd}: give --masters gcache://HOST:PORT,... or set {MASTERS_ENV}")
    return MasterClient(url, resolve_token(args.token_file))


def _shown(text: object) -> str:
    """``text`` as it may be printed in a table: a name with spaces, control characters or escape
    sequences (a record from an older master) is quoted and escaped, never sent to the terminal."""
    s = str(text)
    return s if s.isascii() and s.isprintable() and " " not in s else ascii(s)


def cmd_status(args: argparse.Namespace) -> int:
    from gcache.sizes import format_size

    mc = _master_client(args)
    try:
        out = mc.call("Status", {})
    finally:
        mc.close()
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    m = out["membership"]
    info = out["master"]
    print(f"epoch {m['epoch']}   leader {info.get('leader')}   answered by {info.get('grpc')}")
    if m.get("transition"):
        print(f"handover in progress (epoch {m['transition']['epoch']}): waiting for "
              f"{', '.join(map(_shown, m['transition']['pending']))}")
    stats: dict = {}
    if m["nodes"]:
        from gcache.client import Client
        from gcache.meta.membership import Membership

        try:
            with Client(Membership.from_master(m), token=mc.token, timeout_s=1.0) as c:
                stats = c.stats()
        except GCacheError:
            stats = {}
    print(f"{'node':<10} {'address':<22} {'state':<9} {'inc':>4} {'capacity':>10} {'used':>10} {'keys':>8} {'hb age':>7}")
    for r in m["nodes"]:
        s = stats.get(r["id"], {})
        used = s.get("ram_used", 0) + s.get("disk_used", 0)
        keys = s.get("ram_keys", 0) + s.get("disk_keys", 0)
        age = out.get("heartbeat_age_s", {}).get(r["id"])
        print(f"{_shown(r['id']):<10} {_shown(r['address']):<22} {r['state'].upper():<9} {r['inc']:>4} "
              f"{format_size(r['capacity']):>10} {format_size(used) if s and 'error' not in s else '-':>10} "
              f"{keys if s and 'error' not in s else '-':>8} {'-' if age is None else f'{age:.1f}s':>7}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    import time

    if not args.node:
        raise SystemExit("gcache drain: give the node id (or --config FILE with a [daemon] section)")
    mc = _master_client(args)
    try:
        out = mc.call("Drain", {"node": args.node}, timeout_s=5.0)
        print(f"draining {args.node} (epoch {out['epoch']}); its keys move to their new owners")
        if args.no_wait:
            return 0
        deadline = time.monotonic() + args.timeout
        t0 = time.monotonic()
        try:
            while time.monotonic() < deadline:
                m = mc.membership()
                rec = next((r for r in m["nodes"] if r["id"] == args.node), None)
                if rec is None:
                    print(f"{args.node} drained and left the cluster in {time.monotonic() - t0:.1f}s "
                          f"(epoch {m['epoch']})")
                    return 0
                print(f"  waiting for {args.node} to hand its keys over ({time.monotonic() - t0:.0f}s)", end="\r",
                      flush=True)
                time.sleep(0.2)
        except KeyboardInterrupt:
            print(f"\ngcache drain: interrupted; the drain of {args.node} goes on in the cluster "
                  "(gcache status shows it)", file=sys.stderr)
            return 130
        print(f"gcache drain: {args.node} did not finish within {args.timeout}s", file=sys.stderr)
        return 1
    finally:
        mc.close()


def _os_error(exc: OSError) -> str:
    """One line for a failed file operation: 'PATH: reason'."""
    reason = exc.strerror or str(exc)
    return f"{exc.filename}: {reason}" if exc.filename else reason


def _read_value(path: str, limit: int) -> bytes:
    """The value in file ``path`` (``-``: standard input), at most ``limit`` bytes: more is
    refused before it is all read (``--file /dev/zero`` would read until memory ran out)."""
    from gcache.sizes import format_size

    name = "standard input" if path == "-" else path
    try:
        if path == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
    except OSError as exc:
        raise SystemExit(f"gcache put: cannot read --file {_os_error(exc)}") from None
    if len(data) > limit:
        raise SystemExit(f"gcache put: --file {name} holds more than --max-size {format_size(limit)} (a daemon "
                         f"refuses values above its --max-value); give --max-size SIZE for daemons started with "
                         f"a larger --max-value")
    return data


def cmd_put(args: argparse.Namespace) -> int:
    if args.file is not None and args.value is not None:
        args.usage_error("give the value or --file, not both")
    if args.file is None and args.value is None:  # an empty value is stored only when asked for ("")
        args.usage_error('give the value ("" for an empty one), --file FILE, or --file - to read standard input')
    if args.file is not None:
        from gcache.sizes import parse_size

        data = _read_value(args.file, parse_size(args.max_size))
    else:
        data = args.value.encode()
    with _client(args) as c:
        st = c.put_one(args.key, data, ttl_s=args.ttl)
    print(st.name)
    return 0 if st.name == "OK" else 1


def _writable_file_error(path: str) -> str | None:
    """Why ``path`` cannot be written as a file (checked before fetching a value), or None."""
    import os

    if os.path.isdir(path):
        return f"{path}: is a directory"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"{path}: directory {parent} does not exist"
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        return f"{path}: permission denied"
    return None


def cmd_get(args: argparse.Namespace) -> int:
    if args.out and (err := _writable_file_error(args.out)):
        raise SystemExit(f"gcache get: cannot write --out {err}")
    with _client(args) as c:
        value = c.get_one(args.key)
    if value is None:
        print("NOT_FOUND", file=sys.stderr)
        return 1
    if args.out:
        try:
            with open(args.out, "wb") as f:
                f.write(value)
        except OSError as exc:
            raise SystemExit(f"gcache get: cannot write --out {_os_error(exc)}") from None
    else:
        sys.stdout.buffer.write(value)  # the exact bytes: a pipe or a redirect gets the value as stored
        sys.stdout.buffer.flush()
    return 0


def cmd_exists(args: argparse.Namespace) -> int:
    with _client(args) as c:
        found = c.exists(args.keys)
    for k, f in zip(args.keys, found):
        print(f"{k}\t{'yes' if f else 'no'}")
    return 0 if all(found) else 1


def cmd_clear(args: argparse.Namespace) -> int:
    from gcache.protocol import namespace_error

    if err := namespace_error(args.namespace):
        print(f"gcache clear: --namespace: {err}", file=sys.stderr)
        return 2
    if not args.yes:
        print(f"gcache clear: this deletes every key of namespace {args.namespace!r} on every daemon (other "
              "deployments using it lose their entries too); add --yes to do it", file=sys.stderr)
        return 2
    with _client(args) as c:
        res = c.clear(timeout_s=args.timeout)
    for node, n in res.deleted.items():
        print(f"{node}\tcleared\t{n} keys deleted")
    for node, why in res.failed.items():
        print(f"{node}\tNOT CLEARED\t{why}")
    if not res.complete:
        # running it again helps a daemon that was unreachable or busy, not one that refused the token
        refused = [n for n, why in res.failed.items() if why.endswith(AUTH_REFUSED)]
        what = AUTH_HINT if refused else "run it again"
        print(f"gcache clear: {len(res.failed)} of {len(res.failed) + len(res.deleted)} daemons did not acknowledge: "
              f"namespace {args.namespace!r} is NOT cleared there (they keep its keys); {what}",
              file=sys.stderr)
        return 1
    print(f"namespace {args.namespace!r} cleared on all {len(res.deleted)} daemons "
          f"({sum(res.deleted.values())} keys deleted)")
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from gcache.sizes import format_size

    with _client(args) as c:
        stats = c.stats()
    failed = sorted(node for node, s in stats.items() if "error" in s)
    code = 1 if failed else 0
    if failed:
        print(f"gcache stats: {len(failed)} of {len(stats)} nodes did not answer: {', '.join(failed)}",
              file=sys.stderr)
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return code
    print(f"{'node':<22} {'ram used':>10} {'ram keys':>9} {'disk used':>10} {'disk keys':>9} "
          f"{'hits ram':>9} {'hits disk':>9} {'misses':>8} {'evicted':>8}")
    for node, s in stats.items():
        if "error" in s:
            print(f"{node:<22} unreachable: {s['error']}")
            continue
        print(f"{node:<22} {format_size(s.get('ram_used', 0)):>10} {s.get('ram_keys', 0):>9} "
              f"{format_size(s.get('disk_used', 0)):>10} {s.get('disk_keys', 0):>9} {s.get('hits_ram', 0):>9} "
              f"{s.get('hits_nvme', 0):>9} {s.get('misses', 0):>8} {s.get('evictions', 0):>8}")
    endpoints = {node: s["metrics_address"] for node, s in stats.items() if s.get("metrics_address")}
    if endpoints:  # daemons started with --metrics-port: a cluster table from their Prometheus metrics
        from gcache.server.metrics import cluster_table

        print()
        print(cluster_table(endpoints))
    return code


def build_parser() -> argparse.ArgumentParser:
    from gcache import __version__, daemon

    p = argparse.ArgumentParser(prog="gcache", description="gcache: a distributed KV-cache store for LLM inference.")
    p.add_argument("--version", action="version", version=f"gcache {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    from gcache.ops import health, health_cli

    d = sub.add_parser("daemon", help="run one gcached daemon (data plane over TCP)")
    daemon.add_arguments(d)
    health.add_arguments(d, with_port=False)
    d.set_defaults(fn=daemon.run)

    from gcache import masterd as master

    m = sub.add_parser("master", help="run one master of the Raft-replicated membership group")
    master.add_arguments(m)
    health.add_arguments(m, with_port=True)
    m.set_defaults(fn=master.run)

    h = sub.add_parser("health", help="probe daemons' /healthz + /readyz and the masters; exit 0 when all are ready")
    health_cli.add_arguments(h)
    h.set_defaults(fn=health_cli.run)

    cf = sub.add_parser("config", help="work with a gcache.toml config file")
    cf_sub = cf.add_subparsers(dest="config_cmd", required=True)
    cc = cf_sub.add_parser("check", help="validate config files; print FILE:LINE: key: problem for each error")
    cc.description = ("Check config files as the processes that read them would: every key's type, and what "
                      "gcache daemon and gcache master would refuse to start with (their own checks, on the "
                      "file's values), the token files read. Exit status 0 when every file is ok.")
    cc.add_argument("files", nargs="+", metavar="FILE")
    cc.add_argument("--shared", action="store_true",
                    help="FILE is shared by hosts that add their own flags and mount the token (a Kubernetes "
                         "ConfigMap): do not require what a flag may give (a master's raft) and do not read "
                         "token_file")
    cc.set_defaults(fn=cmd_config_check)

    st = sub.add_parser("status", help="membership table (node, state, epoch, capacity, used, keys) from any master")
    st.add_argument("--masters", default=None, help=MASTERS_HELP)
    st.add_argument("--token-file", default=None, help=TOKEN_FILE_HELP)
    st.add_argument("--json", action="store_true", help="print raw JSON")
    st.set_defaults(fn=cmd_status)

    dr = sub.add_parser("drain", help="drain a node: its keys move to their new owners, hottest first, then it leaves")
    dr.add_argument("node", nargs="?", default=None,
                    help="node id to drain (default with --config: its [daemon] node_id, else its advertised address, "
                         "else its listen address)")
    dr.add_argument("--masters", default=None, help=MASTERS_HELP)
    dr.add_argument("--token-file", default=None, help=TOKEN_FILE_HELP)
    dr.add_argument("--timeout", type=argtypes.seconds, default=600.0,
                    help="give up waiting after this many seconds")
    dr.add_argument("--no-wait", action="store_true", help="return once the drain has started")
    dr.set_defaults(fn=cmd_drain)

    u = sub.add_parser("up", help="start a local cluster of daemons as real processes; Ctrl-C stops them")
    u.add_argument("--nodes", dest="nodes_count", type=argtypes.count_or_zero, default=3,
                   help="number of daemons (default %(default)s; 0 only with --masters)")
    u.add_argument("--mem", type=argtypes.size, default="256MiB",
                   help="RAM arena per daemon (default %(default)s)")
    u.add_argument("--disk", action="store_true", help="give each daemon an NVMe tier under --dir")
    u.add_argument("--disk-size", type=argtypes.size, default="1GiB",
                   help="NVMe budget per daemon with --disk (default %(default)s)")
    u.add_argument("--dir", default=None, help="directory for daemon data and logs (default: a temporary one)")
    u.add_argument("--masters", type=int, default=0, choices=(0, 1, 3, 5),
                   help="also run a Raft master group of this size (daemons register with it)")
    u.add_argument("--no-restart", action="store_true",
                   help="stop the whole cluster when one process exits (default: restart it with backoff)")
    u.set_defaults(fn=cmd_up)

    def data_cmd(name: str, help_: str, namespace_required: bool = False) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help_)
        s.add_argument("--nodes", default=None, help=DEFAULT_NODES_HELP)
        s.add_argument("--masters", default=None, help=MASTERS_HELP + "; routing follows its membership")
        s.add_argument("--token-file", default=None, help=TOKEN_FILE_HELP)
        if namespace_required:
            s.add_argument("--namespace", "-n", required=True, help="namespace (tenant/model; no default)")
        else:
            s.add_argument("--namespace", "-n", default="default", help="namespace (tenant/model; default %(default)s)")
        s.add_argument("--timeout", type=argtypes.seconds, default=2.0,
                       help="call timeout in seconds (default %(default)s)")
        return s

    s = data_cmd("put", "store one value")
    s.add_argument("key")
    s.add_argument("value", nargs="?", help='the value as text ("" for an empty one; or --file)')
    s.add_argument("--file", help="read the value from this file (- for standard input)")
    s.add_argument("--max-size", type=argtypes.size, default=f"{DEFAULT_MAX_VALUE_BYTES >> 20}MiB",
                   help="refuse a --file larger than this (default %(default)s: the daemons' default --max-value)")
    s.add_argument("--ttl", type=argtypes.seconds_or_zero, default=0.0,
                   help="expire after this many seconds (0 = never)")
    s.set_defaults(fn=cmd_put, usage_error=s.error)
    s = data_cmd("get", "read one value (to stdout or --out)")
    s.add_argument("key")
    s.add_argument("--out", help="write the value to this file")
    s.set_defaults(fn=cmd_get)
    s = data_cmd("exists", "check keys")
    s.add_argument("keys", nargs="+")
    s.set_defaults(fn=cmd_exists)
    s = data_cmd("clear", "delete every key of one namespace on every daemon (needs --yes)", namespace_required=True)
    s.description = ("Delete every key of --namespace on every daemon of the membership (RAM and disk; for "
                     "SGLang: KV pages computed with old weights). It drops the whole namespace, whoever wrote "
                     "it. Exit status: 0 when every daemon acknowledged; 1 when any did not (unreachable, timed "
                     "out, refused: it keeps its keys, and stderr says so); 2 without --yes.")
    s.add_argument("--yes", action="store_true",
                   help="really delete (without it the command refuses, deletes nothing and exits 2)")
    s.set_defaults(fn=cmd_clear, timeout=30.0)
    s = data_cmd("stats", "per-node table of memory, disk, hits and evictions")
    s.description = ("Per-node table of memory, disk, hits and evictions. Exit status: 0 when every node "
                     "answered, 1 when any did not (unreachable, busy, refused; the table or JSON still shows "
                     "the others, and stderr names the ones that failed).")
    s.add_argument("--json", action="store_true", help="print raw JSON")
    s.set_defaults(fn=cmd_stats)

    for name in CONFIG_COMMANDS:
        sub.choices[name].add_argument("--config", metavar="FILE", default=None,
                                       help="TOML config file (or $GCACHE_CONFIG); flags override its values")

    from gcache import doctor

    dc = sub.add_parser("doctor", help="which transports, devices and disks this host offers, and what gcache will use")
    doctor.add_arguments(dc)
    dc.set_defaults(fn=doctor.run)

    from gcache.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return p


class _Refusing(argparse.ArgumentParser):
    """A parser that raises what it refuses (argparse.ArgumentError) instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


def _section_parser(command: str, doc: dict) -> argparse.ArgumentParser:
    """``gcache COMMAND``'s parser with ``doc``'s values as its defaults, as ``--config FILE`` makes them."""
    from gcache import daemon, masterd
    from gcache.ops import health
    from gcache.ops.config import apply_defaults, defaults_for

    p = _Refusing(prog=f"gcache {command}", exit_on_error=False)
    (daemon if command == "daemon" else masterd).add_arguments(p)
    health.add_arguments(p, with_port=command == "master")
    apply_defaults(p, defaults_for(doc, command))
    return p


Problems = list[tuple[str | None, str]]  # (argparse dest or None, why), as gcache.ops.config.Validator


def _section_args(command: str, doc: dict, shared: bool) -> tuple[argparse.Namespace | None, Problems]:
    """The arguments ``gcache COMMAND --config FILE`` runs with (no other flags), or None and what
    argparse refuses in them: a flag the command requires that the file does not give (not a
    problem in a ``shared`` file: the flags give it per host) or a value its type refuses."""
    p = _section_parser(command, doc)
    missing = [a for a in p._actions if a.required]  # apply_defaults cleared those the file gives
    if missing:
        return None, [] if shared else [(a.dest, f"missing: gcache {command} needs it ({a.option_strings[0]})")
                                        for a in missing]
    try:
        return p.parse_args([]), []
    except argparse.ArgumentError as exc:  # a file value that the flag's type refuses (e.g. --node-id's)
        dest = next((a.dest for a in p._actions if a.option_strings and exc.argument_name == "/".join(
            a.option_strings)), None)
        return None, [(dest, exc.message if dest else str(exc))]


def _token_file_problems(section: str, doc: dict, shared: bool) -> Problems:
    """The section's ``token_file`` read as the processes read it (not in a ``shared`` file: the
    token is elsewhere, e.g. a Kubernetes Secret mounted in the pods)."""
    from gcache import env

    if shared or "token_file" not in doc.get(section, {}):
        return []
    try:
        env.read_token_file(doc[section]["token_file"])
    except GCacheError as exc:
        return [("token_file", str(exc))]
    return []


def _cluster_problems(doc: dict, shared: bool = False) -> Problems:
    return _token_file_problems("cluster", doc, shared)


def _daemon_section_problems(doc: dict, shared: bool = False) -> Problems:
    """What ``gcache daemon --config FILE`` would refuse in the file's [daemon] section: the
    daemon's own check of its flags (gcache.daemon.settings) on the values the file gives them;
    with a [master] section too, its fence-after against the masters' down-after."""
    from gcache import daemon

    problems = _token_file_problems("daemon", doc, shared)
    args, refused = _section_args("daemon", doc, shared)
    if args is None:
        return problems + refused
    try:
        daemon.settings(args)
    except daemon.FlagError as exc:
        return [*problems, (exc.dest, exc.detail)]
    master = doc.get("master")  # (its own problems, if any, are reported on its own keys)
    down_after = master.get("down_after", _section_parser("master", {}).get_default("down_after")) \
        if isinstance(master, dict) else None
    if isinstance(down_after, (int, float)) and not isinstance(down_after, bool) and (
            bad := daemon.fence_error(args.heartbeat, args.fence_after, down_after)):
        problems.append(bad)
    return problems


def _master_section_problems(doc: dict, shared: bool = False) -> Problems:
    """What ``gcache master --config FILE`` would refuse in the file's [master] section (its own
    check, gcache.masterd.master_config)."""
    from gcache import masterd

    problems = _token_file_problems("master", doc, shared)
    args, refused = _section_args("master", doc, shared)
    if args is None:
        return problems + refused
    try:
        masterd.master_config(args, token="(read apart)")  # the token file: _token_file_problems
    except GCacheError as exc:
        problems.append((getattr(exc, "field", None), str(exc)))
    return problems


def cmd_config_check(args: argparse.Namespace) -> int:
    from functools import partial

    from gcache.ops.config import Validator, check

    validators: dict[str, Validator] = {"cluster": partial(_cluster_problems, shared=args.shared),
                  "daemon": partial(_daemon_section_problems, shared=args.shared),
                  "master": partial(_master_section_problems, shared=args.shared)}
    bad = 0
    for path in args.files:
        problems = check(path, validators)
        for p in problems:
            print(p.format(path), file=sys.stderr)
        bad += len(problems)
        if not problems:
            print(f"{path}: ok")
    return 1 if bad else 0


def _apply_config(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Make the config file's values (--config FILE or $GCACHE_CONFIG) the command's defaults."""
    from gcache.ops.config import apply_defaults, config_path, defaults_for, load

    cmd = next((a for a in argv if not a.startswith("-")), None)
    path = config_path(argv) if cmd in CONFIG_COMMANDS else None
    if not path or cmd is None:
        return
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    apply_defaults(sub, defaults_for(load(path), cmd))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    try:
        _apply_config(parser, argv)
    except GCacheError as exc:
        print(f"gcache: config: {exc}", file=sys.stderr)
        return 2
    from gcache.bench.cli import options_before_subcommand

    if misplaced := options_before_subcommand(argv):
        print(f"gcache bench: {misplaced}", file=sys.stderr)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's usage, not gcache's list of commands
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.cmd]
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.fn(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback (a command says what goes on, if anything)
        print(f"\ngcache {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except GCacheError as exc:
        hint = f"; {AUTH_HINT}" if isinstance(exc, ServerError) and exc.code == ErrorCode.AUTH else ""
        print(f"gcache {args.cmd}: {exc}{hint}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file or directory that is not there, not allowed, not a file: one line
        print(f"gcache {args.cmd}: {_os_error(exc)}", file=sys.stderr)
        return 1
