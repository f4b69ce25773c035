"""The Raft port (pysyncobj) buffers at most a small, fixed amount from a peer that has not
authenticated: before, 104 MiB of zeros streamed to it raised a master's RSS by ~129 MB."""

from __future__ import annotations

import socket
import struct
import time

import pytest

from gcache.cluster import LocalCluster
from gcache.meta.master_client import MasterClient
from tests.conftest import poll

MiB = 1 << 20


def peak_rss(pid: int) -> int:
    """VmHWM: the process's peak resident set, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def settled_peak_rss(pid: int, timeout_s: float = 10.0) -> int:
    """The peak RSS once it has stopped moving (three equal readings 0.1 s apart), polled with a
    deadline; the last reading if it never settles."""
    readings = [peak_rss(pid)]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and (len(readings) < 3 or len(set(readings[-3:])) > 1):
        time.sleep(0.1)
        readings.append(peak_rss(pid))
    return readings[-1]


def stream(address: str, head: bytes, total: int) -> int:
    """Send ``head`` then zeros up to ``total`` bytes; returns how many were accepted before the
    other side closed the connection."""
    host, _, port = address.rpartition(":")
    sent = 0
    chunk = bytes(MiB)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        try:
            s.sendall(head)
            sent = len(head)
            while sent < total:
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
    return sent


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    c = LocalCluster(nodes=0, masters=1, root=str(tmp_path_factory.mktemp("raftguard")))
    c.start()
    yield c
    c.stop()


def core_pid(c: LocalCluster) -> int:
    """The process that owns the Raft port (the master's core, gcache.meta.core)."""
    mc = MasterClient(c.master_url, c.token, timeout_s=5.0)
    try:
        return int(mc.call("Status", {})["master"]["core_pid"])
    finally:
        mc.close()


def raft_address(c: LocalCluster) -> str:
    args = c.master_procs[0].args
    return args[args.index("--raft") + 1]


def still_serves(c: LocalCluster) -> bool:
    mc = MasterClient(c.master_url, c.token, timeout_s=5.0)
    try:
        st = mc.call("Status", {})["master"]
        return bool(st["is_leader"])
    finally:
        mc.close()


@pytest.mark.parametrize("head", [b"", struct.pack("i", 0x7FFFFFFF)], ids=["zeros", "huge-length"])
def test_unauthenticated_stream_is_not_buffered(master, head):
    pid = core_pid(master)
    before = settled_peak_rss(pid)  # start-up allocations done
    stream(raft_address(master), head, 104 * MiB)
    grew = settled_peak_rss(pid) - before  # whatever it buffered, it has read by then
    assert grew < 16 * MiB, f"peak RSS grew by {grew / MiB:.0f} MiB"
    assert still_serves(master)


def test_unauthenticated_connections_cannot_pile_up(master):
    """Each connection still authenticating may hold up to 64 KiB; at most 32 of them are kept
    (a new one closes the oldest), so idle half-handshakes cannot add up."""
    host, _, port = raft_address(master).rpartition(":")
    socks = []
    try:
        for _ in range(60):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(struct.pack("i", 60_000) + bytes(1000))  # a plausible length, then silence
            socks.append(s)

        def open_count() -> int:
            n = 0
            for s in socks:
                s.settimeout(0.01)
                try:
                    n += s.recv(1) != b""
                except TimeoutError:
                    n += 1  # still open, waiting
                except OSError:
                    pass
            return n

        # the last few may still sit in the accept backlog
        assert poll(lambda: open_count() <= 32, 10, every=0.1)
        assert still_serves(master)
    finally:
        for s in socks:
            s.close()


def test_an_idle_peer_link_survives_its_first_send_and_a_silent_peer_still_times_out():
    """pysyncobj closed a link on the first send after a quiet spell longer than its timeout
    (two followers are quiet until an election, so the first vote request was lost and the
    failover took a second round); a peer that answers nothing to what it is sent still times out."""
    from pysyncobj.poller import createPoller
    from pysyncobj.tcp_connection import CONNECTION_STATE

    from gcache.meta.raft_guard import GuardedConnection

    ours, theirs = socket.socketpair()
    conn = GuardedConnection(createPoller("select"), socket=ours, timeout=0.3)
    try:
        time.sleep(0.5)  # quiet both ways for longer than the timeout
        conn.send({"vote": 1})
        assert conn.state == CONNECTION_STATE.CONNECTED
        theirs.settimeout(2)
        assert len(theirs.recv(4096)) > 4  # the message went out
        def sent_until_dropped():  # sent on and on, never answered
            conn.send({"append": 1})
            return conn.state != CONNECTION_STATE.CONNECTED

        assert poll(sent_until_dropped, 5, every=0.05)
        assert conn.state == CONNECTION_STATE.DISCONNECTED
    finally:
        conn.disconnect()
        theirs.close()
