"""A gcache cluster spread over lab hosts: masters and daemons each in their own namespace,
bound to their host's address, and a client driver (tests.faultlab.driver) in another.

    lab = Lab(root, LabConfig(masters=3, daemons=3)).start()
    lab.net.cut(lab.daemon(0), lab.master(1))      # faults: see tests.faultlab.net
    lab.call("get", keys=["k1"])                   # the client, from its own namespace
    lab.close()                                    # processes stopped by PID, namespaces removed

Every process the lab starts is its own child; ``close`` stops exactly those (SIGCONT, SIGTERM,
then SIGKILL after a grace period) and then removes the namespaces and the bridge.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from tests.faultlab.net import Host, Net

MASTER_GRPC, MASTER_RAFT, DAEMON_PORT = 7300, 7301, 7400
PROXY_BASE_PORT = 9400


@dataclass(frozen=True)
class LabConfig:
    """Tight timings by default so the scenarios run in seconds. The fencing rule needs
    fence_after_s + the leader's step-down time (0.6 s) < down_after_s."""

    masters: int = 3
    daemons: int = 3
    heartbeat_s: float = 0.2
    fence_after_s: float = 1.0
    suspect_after_s: float = 1.2
    down_after_s: float = 2.0
    outage_max_s: float = 15.0
    client_timeout_s: float = 0.5
    mem: str = "16MiB"
    start_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.masters not in (1, 3, 5) or self.daemons < 1:
            raise ValueError("masters must be 1, 3 or 5 and daemons >= 1")


@dataclass
class Proc:
    name: str
    host: Host
    popen: subprocess.Popen
    log_path: str


class Lab:
    def __init__(self, root: str, config: LabConfig | None = None) -> None:
        self.root = root
        self.config = config or LabConfig()
        os.makedirs(root, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.token_file = os.path.join(root, "token")
        with open(self.token_file, "w") as f:
            f.write(self.token + "\n")
        os.chmod(self.token_file, 0o600)
        self.procs: dict[str, Proc] = {}
        self._driver: subprocess.Popen | None = None
        self.net = Net()
        try:
            self.masters = [self.net.add_host(f"m{i}") for i in range(self.config.masters)]
            self.daemons = [self.net.add_host(f"d{i}") for i in range(self.config.daemons)]
            self.client_host = self.net.add_host("client")
        except BaseException:
            self.net.close()
            raise
        self.proxy_host: Host | None = None

    # -- addresses --------------------------------------------------------------------------
    def master(self, i: int) -> Host:
        return self.masters[i]

    def daemon(self, i: int) -> Host:
        return self.daemons[i]

    @property
    def master_url(self) -> str:
        return "gcache://" + ",".join(f"{m.ip}:{MASTER_GRPC}" for m in self.masters)

    @staticmethod
    def grpc_address(m: Host) -> str:
        return f"{m.ip}:{MASTER_GRPC}"

    @staticmethod
    def data_address(d: Host) -> str:
        return f"{d.ip}:{DAEMON_PORT}"

    def node_id(self, d: Host) -> str:
        return d.name

    # -- processes --------------------------------------------------------------------------
    def _spawn(self, name: str, host: Host, args: list[str], ready: str | None = None) -> Proc:
        log_path = os.path.join(self.root, f"{name}.log")
        with open(log_path, "ab") as log:
            popen = subprocess.Popen([*host.prefix(), sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=os.getcwd())
        proc = Proc(name, host, popen, log_path)
        self.procs[name] = proc
        return proc

    def _wait_ready(self, procs: list[tuple[Proc, str]]) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        for proc, ready in procs:
            while not os.path.exists(ready):
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{self.log_tail(proc.name)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{proc.name} not ready:\n{self.log_tail(proc.name)}")
                time.sleep(0.02)

    def start(self) -> Lab:
        c = self.config
        peers = ",".join(f"{m.ip}:{MASTER_RAFT}" for m in self.masters)
        waits = []
        for m in self.masters:
            ready = os.path.join(self.root, f"{m.name}.ready")
            p = self._spawn(m.name, m, ["-m", "gcache", "master", "--id", m.name, "--listen", self.grpc_address(m),
                                        "--raft", f"{m.ip}:{MASTER_RAFT}", "--peers", peers,
                                        "--token-file", self.token_file, "--ready-file", ready,
                                        "--suspect-after", str(c.suspect_after_s), "--down-after", str(c.down_after_s)])
            waits.append((p, ready))
        self._wait_ready(waits)
        waits = []
        for d in self.daemons:
            waits.append(self.start_daemon(d, wait=False))
        self._wait_ready(waits)
        self._start_driver()
        return self

    def start_daemon(self, d: Host, wait: bool = True) -> tuple[Proc, str]:
        c = self.config
        ready = os.path.join(self.root, f"{d.name}.ready")
        if os.path.exists(ready):
            os.unlink(ready)
        p = self._spawn(d.name, d, ["-m", "gcache", "daemon", "--listen", self.data_address(d), "--node-id", d.name,
                                    "--mem", c.mem, "--no-pretouch", "--masters", self.master_url,
                                    "--token-file", self.token_file, "--ready-file", ready,
                                    "--heartbeat", str(c.heartbeat_s), "--fence-after", str(c.fence_after_s),
                                    "--outage-max", str(c.outage_max_s)])
        if wait:
            self._wait_ready([(p, ready)])
        return p, ready

    def _start_driver(self) -> None:
        log = open(os.path.join(self.root, "driver.log"), "ab")  # noqa: SIM115 - the child holds it
        self._driver = subprocess.Popen(
            [*self.client_host.prefix(), sys.executable, "-m", "tests.faultlab.driver", "--masters", self.master_url,
             "--token-file", self.token_file, "--timeout", str(self.config.client_timeout_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, cwd=os.getcwd())
        log.close()
        self._read_reply(self.config.start_timeout_s)

    def call(self, cmd: str, timeout_s: float = 30.0, **kw: Any) -> dict[str, Any]:
        """Run one command in the client driver (tests.faultlab.driver.Driver.handle)."""
        assert self._driver is not None and self._driver.stdin is not None
        self._driver.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        self._driver.stdin.flush()
        out = self._read_reply(timeout_s)
        if "exception" in out:
            raise RuntimeError(f"driver {cmd}: {out['exception']}")
        return out

    def _read_reply(self, timeout_s: float) -> dict[str, Any]:
        assert self._driver is not None and self._driver.stdout is not None
        ready, _, _ = select.select([self._driver.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"the client driver did not answer within {timeout_s}s:\n{self.log_tail('driver')}")
        line = self._driver.stdout.readline()
        if not line:
            raise RuntimeError(f"the client driver exited:\n{self.log_tail('driver')}")
        return json.loads(line)

    # -- observation ------------------------------------------------------------------------
    def status(self, m: Host) -> dict[str, Any]:
        return self.call("status", master=self.grpc_address(m))

    def answered_status(self, m: Host, timeout_s: float = 5.0) -> dict[str, Any]:
        """status() of a master that is up, waiting out a call lost on a busy machine (an
        {"error": ...} answer) for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status(m)
            if "error" not in st or time.monotonic() > deadline:
                return st
            time.sleep(0.05)

    def leader(self, among: list[Host] | None = None) -> Host | None:
        """The master that says it leads (the highest term if two do), or None."""
        best = None
        for m in among or self.masters:
            st = self.status(m).get("master", {})
            if st.get("is_leader") and (best is None or (st.get("term") or 0) > best[1]):
                best = (m, st.get("term") or 0)
        return best[0] if best else None

    def states(self, via: Host | None = None, timeout_s: float = 5.0) -> dict[str, tuple[str, int]]:
        """node id -> (state, incarnation) as the leader (or ``via``) publishes it; waits out an
        election (or a status call lost on a busy machine) for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = via or self.leader()
            st = self.status(m) if m is not None else {}
            if "membership" in st:
                return {r["id"]: (r["state"], r["inc"]) for r in st["membership"]["nodes"]}
            if time.monotonic() > deadline:
                raise TimeoutError(f"no master answered with the membership within {timeout_s}s: {st}")
            time.sleep(0.05)

    def serves(self, d: Host, keys: list[str] | None = None) -> dict[str, Any]:
        """One GET straight to daemon ``d`` from the client host: {"served": bool, "fenced": ...}."""
        return self.call("raw", address=self.data_address(d), keys=keys or ["k0"])

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.procs[name].log_path if name in self.procs else os.path.join(self.root, f"{name}.log")
        try:
            with open(path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    # -- latency ------------------------------------------------------------------------------
    def delay(self, src: Host, dests: list[tuple[str, int]], delay_ms: float, jitter_ms: float = 0.0) -> None:
        """``src``'s TCP connections to each (ip, port) go through a delay proxy on a host of its own."""
        if self.proxy_host is None:
            self.proxy_host = self.net.add_host("proxy")
        base = PROXY_BASE_PORT + 100 * len([n for n in self.procs if n.startswith("proxy")])
        maps = [f"{self.proxy_host.ip}:{base + i}={ip}:{port}" for i, (ip, port) in enumerate(dests)]
        name = f"proxy{len([n for n in self.procs if n.startswith('proxy')])}"
        log_path = os.path.join(self.root, f"{name}.log")
        with open(log_path, "ab") as log:
            popen = subprocess.Popen([*self.proxy_host.prefix(), sys.executable, "-m", "tests.faultlab.proxy",
                                      "--delay-ms", str(delay_ms), "--jitter-ms", str(jitter_ms), *maps],
                                     stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, cwd=os.getcwd())
        self.procs[name] = Proc(name, self.proxy_host, popen, log_path)
        assert popen.stdout is not None
        ready, _, _ = select.select([popen.stdout], [], [], self.config.start_timeout_s)
        if not ready or popen.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"delay proxy did not start:\n{self.log_tail(name)}")
        for i, (ip, port) in enumerate(dests):
            self.net.redirect(src, ip, port, self.proxy_host.ip, base + i)

    # -- teardown -----------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name].popen
        if p.poll() is None:
            p.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                p.wait(timeout=15)

    def close(self) -> None:
        if self._driver is not None:
            try:
                if self._driver.poll() is None and self._driver.stdin is not None:
                    self._driver.stdin.write(b'{"cmd": "quit"}\n')
                    self._driver.stdin.flush()
                self._driver.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self._driver.kill()
                self._driver.wait()
        for proc in self.procs.values():
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGCONT)
                proc.popen.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait()
        self.net.close()
