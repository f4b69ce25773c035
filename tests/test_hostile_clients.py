"""Hostile and careless clients against a live daemon: memory before and after authentication,
the descriptor limit, and how much they can make the daemon log.

Memory is the daemon's own, read from /proc/PID/status (VmRSS now, VmHWM the peak)."""

import os
import resource
import socket
import struct
import subprocess
import sys
import time

import msgpack
import pytest

from gcache import Client, LocalPath, Status
from gcache import protocol as P
from gcache.cluster import LocalCluster
from gcache.net.wire import recv_exact
from tests.conftest import poll

MiB = 1 << 20


def status_mib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")




def header(op, meta_len, payload_len=0, req_id=1):
    return struct.pack("<4sBBHQIQ", P.MAGIC, P.VERSION, op, 0, req_id, meta_len, payload_len)


def frame(op, meta, payload=b"", req_id=1):
    raw = msgpack.packb(meta, use_bin_type=True)
    return header(op, len(raw), len(payload), req_id) + raw + payload


def connect(address, timeout=5.0):
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=timeout)


def read_reply(sock):
    hdr = bytearray(P.HEADER_SIZE)
    recv_exact(sock, memoryview(hdr))
    _v, _op, flags, _req_id, meta_len, payload_len = P.unpack_header(hdr)
    meta = bytearray(meta_len)
    recv_exact(sock, memoryview(meta))
    recv_exact(sock, memoryview(bytearray(payload_len)))
    return flags, P.decode_meta(meta)


def closed_by_daemon(sock):
    """Whether the daemon has closed ``sock`` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        while True:
            if sock.recv(65536) == b"":
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def works(address, token=None, local=LocalPath.AUTO):
    with Client([address], timeout_s=5, token=token, local=local) as c:
        value = os.urandom(10_000)
        return c.put_one("legit", value) is Status.OK and c.get_one("legit") == value


def token_cluster(make_cluster, tmp_path, *extra):
    path = tmp_path / "token"
    path.write_text("s3cret-token\n")
    return make_cluster(nodes=1, mem="16MiB", extra_args=["--token-file", str(path), *extra]), "s3cret-token"


# -- item 8: memory before and after authentication ---------------------------------------------
def test_unauthenticated_frames_cannot_make_the_daemon_allocate(make_cluster, tmp_path):
    c, token = token_cluster(make_cluster, tmp_path)
    addr, pid = c.addresses[0], c.daemons[0].pid
    base = status_mib(pid, "VmRSS")
    socks = []
    for i in range(40):  # 16 MiB of declared metadata each, none of it sent
        s = connect(addr)
        s.sendall(header(P.Op.HELLO if i % 2 else P.Op.PUT, 16 * MiB - 1))
        socks.append(s)
    for s in socks:  # each is refused at once, before any metadata is read
        flags, meta = read_reply(s)
        assert flags & P.FLAG_ERROR and meta["code"] == P.ErrorCode.AUTH, meta
    assert all(poll(lambda s=s: closed_by_daemon(s), 5) for s in socks)
    assert works(addr, token)
    assert status_mib(pid, "VmHWM") - base < 24, "unauthenticated frames made the daemon allocate"
    for s in socks:
        s.close()


def test_metadata_declared_but_never_sent_is_bounded_and_timed_out(make_cluster):
    c = make_cluster(nodes=1, mem="16MiB", extra_args=["--frame-timeout", "1.5", "--meta-budget", "32MiB"])
    addr, pid = c.addresses[0], c.daemons[0].pid
    base = status_mib(pid, "VmRSS")
    socks = []
    for _ in range(40):  # no token on this cluster: everyone is authenticated
        s = connect(addr)
        s.sendall(header(P.Op.PING, 16 * MiB - 1) + b"\x80")  # one byte of metadata, then silence
        socks.append(s)
    assert works(addr)  # small requests never wait for the metadata budget
    assert status_mib(pid, "VmRSS") - base < 24
    assert all(poll(lambda s=s: closed_by_daemon(s), 10) for s in socks), "stalled frames were not timed out"
    assert works(addr)
    assert status_mib(pid, "VmHWM") - base < 32
    for s in socks:
        s.close()


def test_slowloris_connections_cost_little_and_are_closed(make_cluster):
    c = make_cluster(nodes=1, mem="16MiB", extra_args=["--frame-timeout", "1"])
    addr, pid = c.addresses[0], c.daemons[0].pid
    assert works(addr)
    base = status_mib(pid, "VmRSS")
    socks = []
    for _ in range(300):
        s = connect(addr)
        s.sendall(b"G")  # one byte of a header, then nothing
        socks.append(s)
    assert works(addr)
    held = status_mib(pid, "VmRSS") - base
    assert held < 48, f"300 one-byte connections hold {held:.0f} MiB"
    assert all(poll(lambda s=s: closed_by_daemon(s), 15) for s in socks), "half-sent headers were not timed out"
    for s in socks:
        s.close()
    assert poll(lambda: status_mib(pid, "VmRSS") - base < 24, 5), "memory not returned after the connections closed"
    assert works(addr)


def test_hostile_metadata_is_refused_without_holding_memory(make_cluster):
    c = make_cluster(nodes=1, mem="16MiB")
    addr, pid = c.addresses[0], c.daemons[0].pid
    base = status_mib(pid, "VmRSS")
    big_map = msgpack.packb({str(j): j for j in range(1_200_000)})  # ~15 MB, 1.2 M entries
    # 60 arrays of 65,536 empty arrays: 4 M Python lists out of 4 MB of metadata
    bomb = b"\xdc\x00\x3c" + (b"\xdd\x00\x01\x00\x00" + b"\x90" * 65536) * 60
    s = connect(addr, timeout=30)
    for i, raw in enumerate([big_map, bomb, big_map, bomb]):
        s.sendall(header(P.Op.PING, len(raw), req_id=i + 1) + raw)
        flags, meta = read_reply(s)
        assert flags & P.FLAG_ERROR and meta["code"] == P.ErrorCode.BAD_META, meta
    s.sendall(frame(P.Op.PING, {}, req_id=9))
    assert read_reply(s)[1]["v"] == P.VERSION  # the connection stayed in sync
    s.close()
    assert works(addr)
    assert status_mib(pid, "VmHWM") - base < 64
    assert poll(lambda: status_mib(pid, "VmRSS") - base < 24, 5)


# -- item 9: the descriptor limit ---------------------------------------------------------------
LIMITED = "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); " \
          "os.execv(sys.executable, [sys.executable, '-m', 'gcache', *sys.argv[2:]])"


def start_daemon(tmp_path, nofile=None, extra=()):
    """A daemon started directly (so its descriptor limit can be set before it starts)."""
    ready = tmp_path / "ready"
    cmd = ["daemon", "--listen", "127.0.0.1:0", "--mem", "16MiB", "--no-pretouch", "--ready-file", str(ready), *extra]
    cmd = [sys.executable, "-c", LIMITED, str(nofile), *cmd] if nofile else [sys.executable, "-m", "gcache", *cmd]
    with open(tmp_path / "daemon.log", "ab") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    assert poll(lambda: ready.exists() or p.poll() is not None, 30) and p.poll() is None, \
        (tmp_path / "daemon.log").read_text()
    return p, ready.read_text().strip()


def flood(addr, n):
    """Open ``n`` idle connections (those the kernel will take); returns them."""
    socks = []
    for _ in range(n):
        try:
            socks.append(connect(addr, timeout=0.5))
        except OSError:
            pass
    return socks


def assert_operator_gets_in(pid, addr):
    def quiet() -> bool:  # the accept loop has settled: a 0.2 s sample under the bound
        c, t = cpu_seconds(pid), time.monotonic()
        time.sleep(0.2)
        return (cpu_seconds(pid) - c) / (time.monotonic() - t) < 0.15

    poll(quiet, 5)  # then measure it over two seconds
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(2.0)  # the measurement window, not a wait for an event
    busy = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)
    assert busy < 0.15, f"the daemon burns {busy:.0%} of a CPU while out of descriptors"
    r = subprocess.run([sys.executable, "-m", "gcache", "stats", "--nodes", addr, "--json", "--timeout", "5"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0 and "unreachable" not in r.stdout and "error" not in r.stdout, r.stdout + r.stderr
    assert works(addr, local=LocalPath.OFF) and works(addr, local=LocalPath.FORCE)  # over TCP and the local path


@pytest.mark.parametrize("how", ["started-low", "lowered-later"])
def test_out_of_descriptors_the_daemon_idles_and_the_operator_gets_in(tmp_path, how):
    if how == "started-low":  # the connection cap sits below the limit
        p, addr = start_daemon(tmp_path, nofile=256)
    else:  # the limit drops under a running daemon: accept() itself fails with EMFILE
        p, addr = start_daemon(tmp_path, extra=["--max-connections", "100000"])
        used = len(os.listdir(f"/proc/{p.pid}/fd"))
        resource.prlimit(p.pid, resource.RLIMIT_NOFILE, (used + 40, used + 40))
    socks = []
    try:
        socks = flood(addr, 400)
        assert len(socks) > 100
        assert_operator_gets_in(p.pid, addr)
        log = (tmp_path / "daemon.log").read_text()
        assert log.count("descriptors") + log.count("connections") < 40, "one log line per refused connection"
    finally:
        for s in socks:
            s.close()
        p.terminate()
        p.wait(timeout=30)


# -- item 10 (logs): rate-limited refusals, no traceback for a half-sent header -----------------
def test_refusals_and_torn_headers_are_logged_rate_limited(make_cluster, tmp_path):
    c, token = token_cluster(make_cluster, tmp_path)
    addr = c.addresses[0]
    for i in range(100):
        s = connect(addr)
        s.sendall(frame(P.Op.HELLO, {"token": "wrong"}))
        assert read_reply(s)[1]["code"] == P.ErrorCode.AUTH
        s.close()
    for i in range(50):
        s = connect(addr)
        s.sendall(frame(P.Op.HELLO, {"token": token}) + header(P.Op.PING, 0)[:10])
        read_reply(s)
        s.close()
    assert works(addr, token)
    with open(c.daemons[0].log_path) as f:
        log = f.read()
    assert "Traceback" not in log
    refusals = [line for line in log.splitlines() if "refused" in line]
    assert 1 <= len(refusals) <= 10, f"{len(refusals)} refusal lines for 100 refusals"


def test_master_logs_refused_rpcs_rate_limited(tmp_path):
    import grpc

    from gcache.meta import rpc

    with LocalCluster(nodes=0, masters=1, root=str(tmp_path / "c")) as c:
        with grpc.insecure_channel(c.master_procs[0].address) as channel:
            call = channel.unary_unary(f"/{rpc.SERVICE}/Status", request_serializer=rpc.pack,
                                       response_deserializer=rpc.unpack)
            for _ in range(60):
                with pytest.raises(grpc.RpcError) as err:
                    call({}, metadata=[(rpc.TOKEN_HEADER, "wrong")], timeout=5)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        with open(c.master_procs[0].log_path) as f:
            log = f.read()
    refusals = [line for line in log.splitlines() if "refused" in line]
    assert 1 <= len(refusals) <= 10, f"{len(refusals)} refusal lines for 60 refused calls"
