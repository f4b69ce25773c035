"""Run inside a private network namespace (``unshare --net``): three "hosts" as three addresses
on its loopback, each with one config file made from deploy/gcache.toml the way docs/deploy.md
says (this host's addresses, test sizes), each running the systemd units' ExecStart commands for
a master and a daemon. Prints a JSON report; the test asserts on it."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOSTS = (("gpu-a", "198.18.0.11", "m1"), ("gpu-b", "198.18.0.12", "m2"), ("gpu-c", "198.18.0.13", "m3"))
OWN_KEYS = ("listen", "raft", "metrics_host", "host")


def host_config(template: str, name: str, ip: str, mid: str, tmp: Path) -> str:
    out = []
    for line in template.splitlines():
        key = line.split("=", 1)[0].strip()
        if key in OWN_KEYS:
            line = line.replace("10.0.0.11", ip)
        line = line.replace("10.0.0.", "198.18.0.")
        line = {"node_id": f'node_id = "{name}"', "id": f'id = "{mid}"', "mem": 'mem = "16MiB"',
                "pretouch": "pretouch = false", "disk": f'disk = "{tmp / name / "nvme"}"',
                "disk_size": 'disk_size = "64MiB"', "token_file": f'token_file = "{tmp / "token"}"',
                }.get(key, line)
        out.append(line)
    return "\n".join(out) + "\n"


def unit_command(unit: str, config: Path) -> list[str]:
    text = (ROOT / "deploy" / "systemd" / unit).read_text()
    line = re.search(r"^ExecStart=(.*)$", text, re.MULTILINE).group(1)
    argv = shlex.split(line.replace("/etc/gcache/%i.toml", str(config)).replace("/etc/gcache/gcache.toml",
                                                                                   str(config)))
    return [sys.executable, "-m", "gcache" if argv[0].endswith("/gcache") else "router", *argv[1:]]


def main(tmp: Path) -> dict:
    t0 = time.monotonic()
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    for _, ip, _ in HOSTS:
        subprocess.run(["ip", "addr", "add", f"{ip}/32", "dev", "lo"], check=True)
    (tmp / "token").write_text("three-hosts-test-token\n")
    template = (ROOT / "deploy" / "gcache.toml").read_text()
    configs, procs = [], []
    for name, ip, mid in HOSTS:
        (tmp / name).mkdir()
        cfg = tmp / name / "gcache.toml"
        cfg.write_text(host_config(template, name, ip, mid, tmp))
        configs.append(cfg)
    from gcache.ops.config import check

    report: dict = {"checks": [len(check(str(c))) for c in configs]}
    def start(unit: str, cfg: Path) -> subprocess.Popen:
        with open(cfg.parent / f"{unit}.log", "ab") as log:
            p = subprocess.Popen(unit_command(unit, cfg), stdout=log, stderr=subprocess.STDOUT)
        procs.append(p)
        return p

    from gcache.ops.health_cli import probe_http

    try:
        # host a first, alone: its master has no quorum, its daemon cannot register; both are live,
        # neither is ready, and `gcache health` says why
        start("gcache-master.service", configs[0])
        lonely = start("gcached@.service", configs[0])
        a = HOSTS[0][1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(probe_http(f"{a}:{port}", 1.0)["live"] for port in (9300, 9400)):
            time.sleep(0.1)
        report["alone"] = {port: probe_http(f"{a}:{port}", 1.0) for port in (9300, 9400)}
        h = subprocess.run([sys.executable, "-m", "gcache", "health", "--config", str(configs[0])], check=False,
                           capture_output=True, text=True)
        report["alone_health"] = [h.returncode, h.stdout]
        lonely.terminate()  # SIGTERM while it waits to register: a prompt, clean exit
        t = time.monotonic()
        report["sigterm_exit"] = [lonely.wait(timeout=30), round(time.monotonic() - t, 1)]
        # then the rest, as the doc says: masters first, then the daemons
        for cfg in configs[1:]:
            start("gcache-master.service", cfg)
        for cfg in configs:
            start("gcached@.service", cfg)
        deadline = time.monotonic() + 90  # every daemon ready (registered), then one `gcache health`
        while time.monotonic() < deadline and not all(
                (r := probe_http(f"{ip}:9400", 1.0))["live"] and r["ready"] for _, ip, _ in HOSTS):
            time.sleep(0.1)
        health = subprocess.run([sys.executable, "-m", "gcache", "health", "--json", "--config", str(configs[0])],
                                check=False, capture_output=True, text=True)
        report["ready_s"] = round(time.monotonic() - t0, 1)
        report["health_rc"] = health.returncode
        report["health"] = json.loads(health.stdout) if health.stdout.startswith("{") else health.stdout
        st = subprocess.run([sys.executable, "-m", "gcache", "status", "--json", "--config", str(configs[1])],
                            check=False, capture_output=True, text=True)
        report["status"] = json.loads(st.stdout) if st.returncode == 0 else st.stderr
        from gcache import Client
        from gcache.meta.rpc import load_token

        cl_cfg = report["status"]["membership"] if isinstance(report["status"], dict) else None
        if cl_cfg:
            masters = "gcache://" + ",".join(f"{ip}:7300" for _, ip, _ in HOSTS)
            with Client(masters, token=load_token(str(tmp / "token")), timeout_s=5.0) as c:
                keys = [f"k{i}" for i in range(30)]
                report["puts"] = [s.name for s in c.put(keys, [k.encode() * 100 for k in keys])]
                report["gets"] = sum(bytes(c.get_one(k) or b"") == k.encode() * 100 for k in keys)
                report["owners"] = sorted({c.stats()[n].get("ram_keys", 0) > 0 for n in c.stats()})
        report["done_s"] = round(time.monotonic() - t0, 1)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        report["logs"] = {f"{c.parent.name}/{u}": (c.parent / f"{u}.log").read_text()[-1500:]
                          for c in configs for u in ("gcache-master.service", "gcached@.service")
                          if (c.parent / f"{u}.log").exists()}
    return report


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
