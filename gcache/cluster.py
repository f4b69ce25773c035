"""A local cluster of real gcached processes on loopback (``gcache up``, the bench, tests)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Self

from gcache.errors import GCacheError
from gcache.ops.supervise import Backoff


@dataclass
class DaemonProc:
    index: int
    node_id: str
    disk_dir: str | None
    ready_file: str
    args: list[str]
    log_path: str
    proc: subprocess.Popen | None = None
    address: str = ""
    kind: str = "daemon"
    # supervision (gcache up): when it started, past pids, pending restart
    started_at: float = 0.0
    pids: list[int] = field(default_factory=list)
    restarts: int = 0
    restart_at: float | None = None
    starting: bool = False  # respawned, ready file not seen yet
    backoff: Backoff = field(default_factory=Backoff)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    @property
    def label(self) -> str:
        return f"{self.kind} {self.node_id}"


def process_state(pid: int) -> str:
    """The kernel's state letter of process ``pid`` (R, S, T, ...; "" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def wait_stopped(pid: int, timeout_s: float = 5.0) -> bool:
    """Until the kernel reports ``pid`` stopped (SIGSTOP takes effect asynchronously); False if
    it is not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while process_state(pid) not in ("T", "t"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalCluster:
    """``nodes`` daemons with ``mem`` of RAM each and, when ``disk`` is set, an NVMe tier of
    that size in a directory of their own under ``root`` (a temporary directory by default).
    Each daemon listens on a free loopback port it picks itself and reports it in a ready file.
    With ``masters`` (1, 3 or 5) a Raft master group runs too, the daemons register with it, and
    everything shares a generated cluster token (``token_file``)."""

    nodes: int = 3
    mem: str = "256MiB"
    disk: str | None = None
    root: str | None = None
    extra_args: list[str] = field(default_factory=list)
    masters: int = 0
    master_args: list[str] = field(default_factory=list)
    start_timeout_s: float = 30.0
    daemons: list[DaemonProc] = field(default_factory=list)
    master_procs: list[DaemonProc] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.nodes < 0 or (self.nodes == 0 and not self.masters):
            raise ValueError("a cluster needs at least one node")
        if self.masters not in (0, 1, 3, 5):
            raise ValueError("masters must be 0, 1, 3 or 5")
        self._own_root = self.root is None
        self.root = self.root or tempfile.mkdtemp(prefix="gcache-cluster-")
        os.makedirs(self.root, exist_ok=True)
        self.token_file = os.path.join(self.root, "token") if self.masters else None
        self.token: str | None = None

    @property
    def addresses(self) -> list[str]:
        return [d.address for d in self.daemons if d.proc is not None]

    @property
    def master_url(self) -> str:
        return "gcache://" + ",".join(m.address for m in self.master_procs)

    def start(self) -> Self:
        """Start the masters and daemons; if any fails to start, stop every one started."""
        assert self.root is not None
        try:
            if self.masters:
                self._start_masters()
            for _ in range(self.nodes):
                self._new_daemon()
            for d in self.daemons:
                self._spawn(d, "127.0.0.1:0")
            for d in self.daemons:
                self._wait_ready(d)
        except BaseException:
            self.stop()
            raise
        return self

    def _new_daemon(self) -> DaemonProc:
        assert self.root is not None
        i = len(self.daemons)
        node_dir = os.path.join(self.root, f"node{i}")
        os.makedirs(node_dir, exist_ok=True)
        args = ["--mem", self.mem, *self.extra_args]
        disk_dir = None
        if self.disk:
            disk_dir = os.path.join(node_dir, "disk")
            args += ["--disk", disk_dir, "--disk-size", self.disk]
        if self.masters:
            args += ["--masters", self.master_url, "--token-file", str(self.token_file)]
        d = DaemonProc(i, f"node{i}", disk_dir, os.path.join(node_dir, "ready"), args,
                       os.path.join(node_dir, "daemon.log"))
        self.daemons.append(d)
        return d

    def add_node(self) -> DaemonProc:
        """Start one more daemon (it registers and takes its share of the ring)."""
        return self.add_nodes(1)[0]

    def add_nodes(self, n: int) -> list[DaemonProc]:
        """Start ``n`` more daemons at once (they register concurrently), then wait for all."""
        new = [self._new_daemon() for _ in range(n)]
        for d in new:
            self._spawn(d, "127.0.0.1:0")
        for d in new:
            self._wait_ready(d)
        return new

    def _start_masters(self) -> None:
        assert self.root is not None and self.token_file is not None
        self.token = secrets.token_hex(16)
        with open(self.token_file, "w") as f:
            f.write(self.token + "\n")
        os.chmod(self.token_file, 0o600)
        rafts = [f"127.0.0.1:{free_port()}" for _ in range(self.masters)]
        for i, raft in enumerate(rafts):
            mdir = os.path.join(self.root, f"master{i}")
            os.makedirs(mdir, exist_ok=True)
            args = ["--raft", raft, "--peers", ",".join(rafts), "--token-file", self.token_file,
                    "--id", f"m{i}", *self.master_args]
            self.master_procs.append(DaemonProc(i, f"m{i}", None, os.path.join(mdir, "ready"), args,
                                                os.path.join(mdir, "master.log"), kind="master"))
        for m in self.master_procs:
            self._spawn(m, f"127.0.0.1:{free_port()}")
        for m in self.master_procs:
            self._wait_ready(m)

    def _spawn(self, d: DaemonProc, listen: str) -> None:
        if os.path.exists(d.ready_file):
            os.unlink(d.ready_file)
        node_flag = ["--node-id", d.node_id] if d.kind == "daemon" else []
        cmd = [sys.executable, "-m", "gcache", d.kind, "--listen", listen, *node_flag,
               "--ready-file", d.ready_file, *d.args]
        with open(d.log_path, "ab") as log:
            d.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        d.started_at = time.monotonic()
        d.pids.append(d.proc.pid)

    def _wait_ready(self, d: DaemonProc) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if d.proc is not None and d.proc.poll() is not None:
                raise GCacheError(f"daemon {d.node_id} exited with {d.proc.returncode}:\n{self.log_tail(d)}")
            try:
                with open(d.ready_file) as f:
                    d.address = f.read().strip()
                return
            except FileNotFoundError:
                time.sleep(0.02)
        raise GCacheError(f"daemon {d.node_id} not ready within {self.start_timeout_s}s:\n{self.log_tail(d)}")

    def log_tail(self, d: DaemonProc, lines: int = 20) -> str:
        try:
            with open(d.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def kill(self, index: int, sig: int = signal.SIGKILL, master: bool = False) -> None:
        """Send ``sig``; SIGKILL / SIGTERM return once the process has exited, SIGSTOP once the
        kernel reports it stopped (delivery is asynchronous: a daemon sent SIGSTOP could still
        answer a request sent right after, which a test then took for a stopped one answering)."""
        d = (self.master_procs if master else self.daemons)[index]
        if d.proc is not None and d.proc.poll() is None:
            d.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                d.proc.wait(timeout=30)
            elif sig == signal.SIGSTOP:
                wait_stopped(d.proc.pid)

    def restart(self, index: int, master: bool = False) -> None:
        """Start a stopped daemon (or master) again on the same port and disk directory."""
        d = (self.master_procs if master else self.daemons)[index]
        if d.proc is not None and d.proc.poll() is None:
            raise GCacheError(f"daemon {d.node_id} is still running")
        self._spawn(d, d.address)
        self._wait_ready(d)

    def supervise_once(self, now: float | None = None) -> list[str]:
        """One supervision round (``gcache up`` calls it a few times a second): a process that
        exited is restarted after its backoff, on its own address and data directory, while the
        others keep serving. Returns the events of this round, as lines to print."""
        now = time.monotonic() if now is None else now
        events = []
        for d in self.master_procs + self.daemons:
            if d.proc is None:
                continue
            if d.starting:
                if os.path.exists(d.ready_file):
                    d.starting = False
                    events.append(f"{d.label} back: pid {d.pid} serving on {d.address} (restart {d.restarts})")
                elif d.proc.poll() is None:
                    continue
            code = d.proc.poll()
            if code is None:
                continue
            if d.restart_at is None:
                d.starting = False
                delay = d.backoff.delay_after_exit(now - d.started_at)
                d.restart_at = now + delay
                how = f"signal {-code}" if code < 0 else f"code {code}"
                events.append(f"{d.label} (pid {d.pid}) exited with {how}; restarting in {delay:.1f}s\n"
                              + "".join(f"    | {line}" for line in self.log_tail(d, 5).splitlines(True)))
            elif now >= d.restart_at:
                d.restart_at = None
                d.restarts += 1
                self._spawn(d, d.address)
                d.starting = True
                events.append(f"{d.label} restarting: pid {d.pid} on {d.address}")
        return events

    def exited(self) -> list[DaemonProc]:
        """Processes that are not running (for --no-restart)."""
        return [d for d in self.daemons + self.master_procs if d.proc is not None and d.proc.poll() is not None]

    def summary(self) -> str:
        """What ran: each process, its address, its pids and restarts."""
        rows = []
        for d in self.master_procs + self.daemons:
            up = time.monotonic() - d.started_at if d.proc is not None and d.proc.poll() is None else 0.0
            rows.append(f"  {d.label:<14} {d.address:<22} pids {','.join(map(str, d.pids)) or '-':<20} "
                        f"restarts {d.restarts:<3} {f'up {up:.0f}s' if up else 'stopped'}")
        return "\n".join(rows)

    def stop(self) -> None:
        procs = self.daemons + self.master_procs
        for d in procs:
            if d.proc is not None and d.proc.poll() is None:
                d.proc.send_signal(signal.SIGCONT)
                d.proc.send_signal(signal.SIGTERM)
        for d in procs:
            if d.proc is None:
                continue
            try:
                d.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                d.proc.wait()
        if self._own_root and self.root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
