"""Hosts as network namespaces on one Linux bridge, and the faults between them.

Every host is a namespace with one veth (``eth0``) on a bridge in the root namespace and one
address from 198.18.0.0/15 (reserved for network benchmarks); the root namespace gets no
address, so nothing outside the lab can reach it or be reached from it. Names carry a random
run id, so concurrent runs never collide, and ``Net.close()`` removes everything it created.

Faults (this kernel has no netem):

* a partition: iptables DROP rules inside a host's namespace (``cut``/``heal``), both ways;
* loss: iptables' ``statistic`` match (``loss``);
* rate: a tbf qdisc on the host's eth0 (``rate``);
* latency and jitter: a userspace TCP proxy (tests.faultlab.proxy) with a DNAT rule that sends a
  host's connections to some address through it (``redirect``).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

LAB_NET = ipaddress.ip_network("198.18.0.0/15")
IPTABLES = "iptables-legacy"


class LabUnavailable(Exception):
    """Network namespaces cannot be built here (not root, no ip/iptables); the reason says why."""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def unavailable_reason() -> str | None:
    """Why namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc", IPTABLES):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables; `make system-deps`)"
    probe = f"glprobe{secrets.token_hex(3)}"
    p = sh("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    sh("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str  # short name in the lab (m0, d1, client...)
    netns: str
    ip: str
    veth: str  # root-side end of its veth pair
    rules: list[list[str]] = field(default_factory=list)  # iptables rules added (filter table), to undo

    def exec(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.netns, *args, check=check)

    def prefix(self) -> list[str]:
        """Command prefix that runs a program inside this host."""
        return ["ip", "netns", "exec", self.netns]


class Net:
    def __init__(self) -> None:
        why = unavailable_reason()
        if why:
            raise LabUnavailable(why)
        self.run_id = secrets.token_hex(3)
        self.bridge = f"glb{self.run_id}"
        # one random /24 of the benchmark range per run (different runs are separate bridges anyway)
        third = secrets.randbelow(512)
        base = int(LAB_NET.network_address) + third * 256
        self._subnet = ipaddress.ip_network((base, 24))
        self.hosts: dict[str, Host] = {}
        self._closed = False
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "link", "set", self.bridge, "up")

    def add_host(self, name: str) -> Host:
        i = len(self.hosts)
        ip = str(self._subnet.network_address + 10 + i)
        assert ipaddress.ip_address(ip) in LAB_NET
        netns = f"gl{self.run_id}-{name}"
        veth, peer = f"glv{self.run_id}{i}", f"glp{self.run_id}{i}"
        sh("ip", "netns", "add", netns)
        host = Host(name, netns, ip, veth)
        self.hosts[name] = host
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
        sh("ip", "link", "set", peer, "netns", netns)
        sh("ip", "link", "set", veth, "master", self.bridge)
        sh("ip", "link", "set", veth, "up")
        host.exec("ip", "link", "set", "lo", "up")
        host.exec("ip", "link", "set", peer, "name", "eth0")
        host.exec("ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        host.exec("ip", "link", "set", "eth0", "up")
        return host

    # -- faults -----------------------------------------------------------------------------
    def _rule(self, host: Host, rule: list[str]) -> None:
        host.exec(IPTABLES, "-A", *rule)
        host.rules.append(rule)

    def cut(self, a: Host, *others: Host) -> None:
        """No packet between ``a`` and each of ``others``, either way (silently dropped, so
        callers time out). The rules live in ``a``'s namespace; ``heal(a)`` removes them."""
        ips = ",".join(o.ip for o in others)
        self._rule(a, ["INPUT", "-s", ips, "-j", "DROP"])
        self._rule(a, ["OUTPUT", "-d", ips, "-j", "DROP"])

    def deafen(self, a: Host, *others: Host) -> None:
        """``a`` hears nothing from ``others``; they still hear ``a`` (UDP gets through, TCP does
        not: its handshake needs both ways)."""
        self._rule(a, ["INPUT", "-s", ",".join(o.ip for o in others), "-j", "DROP"])

    def cut_all(self, a: Host) -> None:
        """``a`` hears nobody and nobody hears ``a``."""
        self._rule(a, ["INPUT", "-i", "eth0", "-j", "DROP"])
        self._rule(a, ["OUTPUT", "-o", "eth0", "-j", "DROP"])

    def loss(self, host: Host, probability: float) -> None:
        """Drop this fraction of the packets ``host`` receives."""
        self._rule(host, ["INPUT", "-i", "eth0", "-m", "statistic", "--mode", "random",
                          "--probability", str(probability), "-j", "DROP"])

    def heal(self, host: Host | None = None) -> None:
        """Remove the iptables rules (filter table) added to ``host`` (every host by default)."""
        for h in [host] if host is not None else list(self.hosts.values()):
            for rule in reversed(h.rules):
                h.exec(IPTABLES, "-D", *rule, check=False)
            h.rules.clear()

    def rate(self, host: Host, rate: str, burst: str = "64kb", latency: str = "50ms") -> None:
        """Limit what ``host`` sends to ``rate`` (tbf, e.g. "100mbit")."""
        host.exec("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst,
                  "latency", latency)

    def redirect(self, host: Host, dest_ip: str, dest_port: int, via_ip: str, via_port: int) -> None:
        """``host``'s connections to dest_ip:dest_port go to via_ip:via_port (a delay proxy) instead."""
        host.exec(IPTABLES, "-t", "nat", "-A", "OUTPUT", "-d", dest_ip, "-p", "tcp", "--dport", str(dest_port),
                  "-j", "DNAT", "--to-destination", f"{via_ip}:{via_port}")

    # -- teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for h in self.hosts.values():
            sh("ip", "netns", "del", h.netns, check=False)  # removes its veth end and rules
            sh("ip", "link", "del", h.veth, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
