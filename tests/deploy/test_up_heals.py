"""``gcache up`` heals: a daemon or master killed with SIGKILL comes back on its own address
and data directory while the others keep serving; --no-restart keeps the old behaviour."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from gcache.ops.supervise import Backoff, BackoffPolicy

GCACHE = [sys.executable, "-m", "gcache"]


class Up:
    """A running ``gcache up`` whose output lines are collected by a reader thread."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*GCACHE, "up", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.lines: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, predicate, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for line in self.lines[seen:]:
                if predicate(line):
                    return line
            seen = len(self.lines)
            assert self.proc.poll() is None or seen < len(self.lines), "".join(self.lines)
            time.sleep(0.05)
        raise AssertionError("timed out; output so far:\n" + "".join(self.lines))

    def exports(self) -> dict[str, str]:
        self.wait_for(lambda line: line.startswith("export GCACHE_NODES="))
        return dict(line[len("export "):].strip().split("=", 1) for line in self.lines if line.startswith("export "))

    def pid_of(self, label: str) -> int:
        line = next(line for line in self.lines if line.strip().startswith(label + " ") and " pid " in line)
        return int(line.rsplit(" ", 1)[1])

    def interrupt(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=60)
        self._t.join(timeout=10)
        return "".join(self.lines)


def test_backoff_doubles_then_resets_after_a_stable_run():
    b = Backoff(BackoffPolicy(initial_s=0.5, max_s=4.0, stable_s=60.0))
    assert [b.delay_after_exit(1.0) for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.delay_after_exit(120.0) == 0.5
    with pytest.raises(ValueError):
        BackoffPolicy(initial_s=0)


def test_killed_daemon_and_master_come_back_while_the_rest_serves(tmp_path):
    from gcache import Client, GCacheError, Status
    from gcache.meta.rpc import load_token

    up = Up("--nodes", "2", "--masters", "1", "--mem", "16MiB", "--disk", "--disk-size", "32MiB",
            "--dir", str(tmp_path))
    try:
        env = up.exports()
        token = load_token(env["GCACHE_TOKEN_FILE"])
        addr0, addr1 = env["GCACHE_NODES"].split(",")
        old = up.pid_of("node1")
        os.kill(old, signal.SIGKILL)
        # node0 keeps serving while node1 is down
        with Client([addr0], token=token, timeout_s=5.0) as c:
            assert c.put_one("during", b"x" * 100) is Status.OK and bytes(c.get_one("during")) == b"x" * 100
        up.wait_for(lambda line: "daemon node1 (pid" in line and "exited with signal 9" in line)
        back = up.wait_for(lambda line: "daemon node1 back:" in line)
        assert addr1 in back
        new = int(back.split("pid ")[1].split()[0])
        assert new != old
        with open(f"/proc/{new}/cmdline", "rb") as f:  # same address, same data directory
            argv = f.read().split(b"\0")
        assert addr1.encode() in argv and str(tmp_path / "node1" / "disk").encode() in argv
        # it serves again, registered with the masters (a data request needs a live membership)
        deadline = time.monotonic() + 30
        while True:
            try:
                with Client([addr1], token=token, timeout_s=2.0) as c:
                    if c.put_one("after", b"y" * 100) is Status.OK and bytes(c.get_one("after")) == b"y" * 100:
                        break
            except GCacheError:  # refused until it has registered again: retry
                pass
            assert time.monotonic() < deadline, "restarted node1 does not serve"
            time.sleep(0.1)

        os.kill(up.pid_of("master m0"), signal.SIGKILL)
        up.wait_for(lambda line: "master m0 back:" in line)
        st = subprocess.run([*GCACHE, "status", "--json"], check=False, capture_output=True, text=True, timeout=60,
                            env={**os.environ, **env})
        assert st.returncode == 0, st.stderr
    finally:
        out = up.interrupt()
    assert up.proc.returncode == 0, out
    assert "what ran:" in out and "cluster stopped" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("daemon node1 "))
    assert "restarts 1" in row and str(old) in row


def test_no_restart_stops_the_cluster_when_one_dies(tmp_path):
    up = Up("--nodes", "2", "--mem", "16MiB", "--no-restart", "--dir", str(tmp_path))
    try:
        up.exports()
        os.kill(up.pid_of("node0"), signal.SIGKILL)
        up.proc.wait(timeout=60)
    finally:
        out = up.interrupt()
    assert up.proc.returncode == 1
    assert "daemon node0 exited; stopping" in out and "cluster stopped" in out
