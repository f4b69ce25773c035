"""``gcache health``: probe daemons (their /healthz and /readyz) and masters (gRPC Status);
exit 0 when every target is live and ready, 1 otherwise."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.request import urlopen

from gcache import argtypes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--daemon", action="append", default=[], metavar="HOST:PORT", dest="daemons",
                   help="a daemon's metrics address (its --metrics-port); repeatable (default: from --config)")
    p.add_argument("--master-metrics", action="append", default=[], metavar="HOST:PORT",
                   help="a master's metrics address; repeatable")
    p.add_argument("--masters", default=None, help="gcache://HOST:PORT,... (or env GCACHE_MASTERS): ask each master")
    p.add_argument("--token-file", default=None, help="cluster token file (else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN)")
    p.add_argument("--timeout", type=argtypes.seconds, default=2.0,
                   help="seconds per probe (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(daemon_metrics=None)


def probe_http(address: str, timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {"target": address}
    for name, path in (("live", "/healthz"), ("ready", "/readyz")):
        try:
            with urlopen(f"http://{address}{path}", timeout=timeout_s) as r:
                body = json.loads(r.read() or b"{}")
        except HTTPError as exc:  # 503: not ready, with the reasons in the body
            try:
                body = json.loads(exc.read() or b"{}")
            except ValueError:
                body = {"ok": False, "checks": {"http": {"ok": False, "detail": str(exc)}}}
        except (URLError, OSError, ValueError) as exc:
            body = {"ok": False, "checks": {"reachable": {"ok": False, "detail": str(getattr(exc, "reason", exc))}}}
        out[name] = bool(body.get("ok"))
        out.setdefault("checks", {}).update(body.get("checks", {}))
    return out


def probe_masters(url: str, token_file: str | None, timeout_s: float) -> list[dict[str, Any]]:
    from gcache.errors import GCacheError
    from gcache.meta.master_client import AuthFailed, MasterClient, parse_masters
    from gcache.meta.rpc import load_token

    token = load_token(token_file or os.environ.get("GCACHE_TOKEN_FILE"))
    out = []
    for address in parse_masters(url):
        mc = MasterClient([address], token, timeout_s=timeout_s)
        row: dict[str, Any] = {"target": address, "kind": "master"}
        try:
            st = mc.call("Status", {})
            info, m = st["master"], st["membership"]
            leader = info.get("leader")
            row.update(live=True, ready=leader is not None, checks={
                "leader": {"ok": leader is not None, "detail": f"leader {leader}" if leader else "no Raft leader"},
                "role": {"ok": True, "detail": "leader" if info.get("is_leader") else "follower"},
            })
            bad = [f"{n['id']} {n['state']}" for n in m["nodes"] if n["state"] != "up"]
            row["checks"]["nodes"] = {"ok": not bad, "detail": f"epoch {m['epoch']}: {len(m['nodes'])} nodes"
                                      + (f"; not up: {', '.join(bad)}" if bad else ", all up")}
            row["ready"] = row["ready"] and not bad
        except AuthFailed as exc:  # it answered: up, but this command's token is not the cluster's
            row.update(live=True, ready=False, refused=True, checks={"token": {"ok": False, "detail": str(exc)}})
        except GCacheError as exc:
            row.update(live=False, ready=False, checks={"reachable": {"ok": False, "detail": str(exc)}})
        finally:
            mc.close()
        out.append(row)
    return out


def run(args: argparse.Namespace) -> int:
    daemons = list(args.daemons) or ([args.daemon_metrics] if args.daemon_metrics else [])
    masters = args.masters or os.environ.get("GCACHE_MASTERS")
    if not daemons and not args.master_metrics and not masters:
        print("gcache health: give --daemon HOST:PORT, --master-metrics HOST:PORT, --masters gcache://... "
              "or --config FILE", file=sys.stderr)
        return 2
    rows = [{**probe_http(a, args.timeout), "kind": "daemon"} for a in daemons]
    rows += [{**probe_http(a, args.timeout), "kind": "master"} for a in args.master_metrics]
    if masters:
        rows += probe_masters(masters, args.token_file, args.timeout)
    ok = all(r["live"] and r["ready"] for r in rows)
    if args.json:
        print(json.dumps({"ok": ok, "targets": rows}, indent=2, sort_keys=True))
    else:
        for r in rows:
            state = ("REFUSED" if r.get("refused") else "READY" if r["live"] and r["ready"]
                     else "LIVE" if r["live"] else "DOWN")
            why = "; ".join(f"{k}: {c['detail']}" for k, c in r["checks"].items() if not c["ok"]) or \
                "; ".join(c["detail"] for c in r["checks"].values())
            print(f"{r['kind']:<7} {r['target']:<22} {state:<7} {why}")
        print("healthy" if ok else "NOT healthy")
    return 0 if ok else 1
