"""Bad input to the gcache command and the daemon: refused with one clear line that names the
problem and a non-zero exit, never a Python traceback; the daemon says what was wrong with a
frame's metadata."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys

import msgpack
import pytest

from gcache import cli
from gcache import protocol as P
from tests.test_bad_input import read_reply

GCACHE = [sys.executable, "-m", "gcache"]


def closed_port() -> int:
    """A loopback port nothing listens on (connection refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gcache(capsys, *argv: str) -> tuple[int, str, str]:
    """Run ``gcache ARGV`` in this process as __main__ would: (exit code, stdout, stderr)."""
    try:
        code: int | str | None = cli.main(list(argv))
    except SystemExit as exc:  # argparse errors, and SystemExit("message") as the interpreter prints it
        code = exc.code
    out, err = capsys.readouterr()
    if isinstance(code, str):
        err, code = err + code + "\n", 1
    return int(code or 0), out, err


def refused(capsys, *argv: str) -> str:
    """The one-line error of a refused command (asserted: non-zero exit, no traceback)."""
    code, _out, err = gcache(capsys, *argv)
    assert code != 0, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "says"), [
    (["daemon", "--metrics-port", "99999"], "argument --metrics-port: expected a port number 0-65535, got 99999"),
    (["daemon", "--log-level", "BOGUS"], "argument --log-level: expected a log level"),
    (["daemon", "--frame-timeout", "nan"], "argument --frame-timeout: must be a finite number of seconds > 0"),
    (["daemon", "--handshake-timeout", "-1"], "argument --handshake-timeout: must be a finite"),
    (["daemon", "--heartbeat", "0"], "argument --heartbeat: must be a finite number of seconds > 0, got 0.0"),
    (["daemon", "--fence-after", "inf"], "argument --fence-after: must be a finite number of seconds > 0, got inf"),
    (["daemon", "--lease", "soon"], "argument --lease: expected a number of seconds, got 'soon'"),
    # below 0.05 s every local get missed and the reaper woke thousands of times a second
    (["daemon", "--lease", "0.001"], "argument --lease: must be a finite number of seconds >= 0.05, got 0.001"),
    (["daemon", "--lease", "0"], "argument --lease: must be a finite number of seconds >= 0.05, got 0.0"),
    (["daemon", "--max-connections", "0"], "argument --max-connections: expected a whole number >= 1"),
    (["daemon", "--mem", "lots"], "argument --mem: cannot read size 'lots'"),
    (["master", "--raft", "127.0.0.1:1", "--peers", "127.0.0.1:1", "--down-after", "nan"],
     "argument --down-after: must be a finite"),
    (["master", "--raft", "127.0.0.1:1", "--peers", "127.0.0.1:1", "--metrics-port", "-1"],
     "argument --metrics-port: expected a port number"),
    (["master", "--raft", "127.0.0.1:1", "--peers", "127.0.0.1:1", "--log-level", "loud"],
     "argument --log-level: expected a log level"),
    (["up", "--nodes", "-1"], "argument --nodes: expected a whole number >= 0, got -1"),
    (["up", "--nodes", "0"], "gcache up: --nodes must be >= 1"),
    (["up", "--mem", "plenty"], "argument --mem: cannot read size 'plenty'"),
    (["put", "k", "v", "--ttl", "-5", "--nodes", "127.0.0.1:1"], "argument --ttl: must be a finite number of seconds >= 0"),
    (["put", "k", "v", "--ttl", "nan", "--nodes", "127.0.0.1:1"], "argument --ttl: must be a finite"),
    (["get", "k", "--timeout", "0", "--nodes", "127.0.0.1:1"], "argument --timeout: must be a finite"),
    (["drain", "node0", "--timeout", "nan"], "argument --timeout: must be a finite"),
    (["health", "--timeout", "-2"], "argument --timeout: must be a finite"),
])
def test_bad_numbers_are_refused_by_name(capsys, argv, says):
    assert says in refused(capsys, *argv)


def test_put_file_that_cannot_be_read(capsys, tmp_path):
    nodes = f"127.0.0.1:{closed_port()}"  # never reached: the file is read first
    missing = tmp_path / "absent"
    assert refused(capsys, "put", "k", "--file", str(missing), "--nodes", nodes) == \
        f"gcache put: cannot read --file {missing}: No such file or directory"
    assert refused(capsys, "put", "k", "--file", str(tmp_path), "--nodes", nodes) == \
        f"gcache put: cannot read --file {tmp_path}: Is a directory"


def test_put_without_a_value_is_a_usage_error_not_an_empty_value(capsys):
    """`gcache put KEY` stored an empty value (a forgotten argument, or a shell variable that
    expanded to nothing, silently overwrote the key). The value, --file FILE or --file - (stdin)
    must be given; "" stores an empty value on purpose."""
    nodes = f"127.0.0.1:{closed_port()}"  # never reached: the arguments are checked first
    code, out, err = gcache(capsys, "put", "k", "--nodes", nodes)
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith("usage: gcache put") and "--file - to read standard input" in err.splitlines()[-1]
    code, _out, err = gcache(capsys, "put", "k", "v", "--file", "/dev/null", "--nodes", nodes)
    assert code == 2 and "give the value or --file, not both" in err
    # "" is explicit: it gets as far as the (closed) node
    assert "Connection refused" in refused(capsys, "put", "k", "", "--nodes", nodes, "--timeout", "1")


def test_put_file_larger_than_the_max_value_is_refused_without_reading_it_all(tmp_path):
    """`gcache put k --file /dev/zero` read until memory ran out (a MemoryError traceback, or
    the OOM killer). At most --max-size (the daemons' default --max-value) + 1 bytes are read
    now, and more is refused by name; a real process under a 1 GiB address-space limit."""
    import resource

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    nodes = f"127.0.0.1:{closed_port()}"  # never reached: the file is refused first
    p = subprocess.run([*GCACHE, "put", "k", "--file", "/dev/zero", "--nodes", nodes], capture_output=True,
                       text=True, timeout=120, check=False, preexec_fn=limited)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == ("gcache put: --file /dev/zero holds more than --max-size 64.0MiB (a daemon refuses "
                                "values above its --max-value); give --max-size SIZE for daemons started with a "
                                "larger --max-value")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    p = subprocess.run([*GCACHE, "put", "k", "--file", "-", "--max-size", "4KiB", "--nodes", nodes],
                       input=big.read_bytes(), capture_output=True, timeout=120, check=False)
    assert p.returncode == 1 and b"--file standard input holds more than --max-size 4.0KiB" in p.stderr, p.stderr


def test_unknown_arguments_print_the_commands_usage(capsys):
    code, _out, err = gcache(capsys, "up", "--bogus")
    assert code == 2 and err.startswith("usage: gcache up") and "{daemon,master" not in err
    assert err.strip().splitlines()[-1] == "gcache up: error: unrecognized arguments: --bogus"


def test_a_refused_token_says_how_to_give_one_and_clear_does_not_say_run_it_again(capsys, make_cluster, tmp_path,
                                                                                 monkeypatch):
    for var in ("GCACHE_TOKEN", "GCACHE_TOKEN_FILE", "GCACHE_MASTERS"):
        monkeypatch.delenv(var, raising=False)
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    nodes = make_cluster(nodes=1, mem="16MiB", extra_args=["--token-file", str(token), "--no-pretouch"]).addresses[0]
    says = refused(capsys, "get", "k", "--nodes", nodes)
    assert "cluster token" in says and "--token-file FILE or $GCACHE_TOKEN_FILE" in says, says
    says = refused(capsys, "clear", "-n", "ns", "--yes", "--nodes", nodes, "--timeout", "5")
    assert "NOT cleared" in says and "run it again" not in says and "--token-file FILE" in says, says
    code, _out, err = gcache(capsys, "get", "k", "--nodes", nodes, "--token-file", str(token))
    assert code == 1 and err.strip() == "NOT_FOUND"  # with the token: an ordinary miss


def test_get_out_path_is_checked_before_fetching(capsys, tmp_path):
    nodes = f"127.0.0.1:{closed_port()}"  # an unreachable node would say so: the path is checked first
    bad = tmp_path / "no" / "dir" / "x"
    assert refused(capsys, "get", "k", "--out", str(bad), "--nodes", nodes) == \
        f"gcache get: cannot write --out {bad}: directory {bad.parent} does not exist"
    assert refused(capsys, "get", "k", "--out", str(tmp_path), "--nodes", nodes).endswith("is a directory")


def test_an_os_error_from_a_command_is_one_line(capsys, monkeypatch):
    def fails(args):
        raise PermissionError(13, "Permission denied", "/var/lib/gcache")

    monkeypatch.setattr(cli, "cmd_exists", fails)
    assert refused(capsys, "exists", "k", "--nodes", "127.0.0.1:1") == \
        "gcache exists: /var/lib/gcache: Permission denied"


def test_stats_exits_non_zero_when_a_node_does_not_answer(capsys):
    down = f"127.0.0.1:{closed_port()}"
    code, out, err = gcache(capsys, "stats", "--nodes", down, "--timeout", "1")
    assert code == 1 and f"1 of 1 nodes did not answer: {down}" in err
    assert "unreachable" in out  # the table still shows it
    code, out, err = gcache(capsys, "stats", "--json", "--nodes", down, "--timeout", "1")
    assert code == 1 and "error" in out and "did not answer" in err
    assert "Exit status" in gcache(capsys, "stats", "--help")[1]


def test_config_check_refuses_what_the_daemon_refuses(tmp_path):
    files = {
        "int_mem.toml": ("[daemon]\nmem = 5\n", ":2: [daemon] mem: mem_bytes=5: the RAM tier needs at least 4 KiB"),
        "zero_mem.toml": ('[daemon]\nlisten = "127.0.0.1:0"\nmem = "0"\n', ":3: [daemon] mem: mem_bytes=0"),
        "small_disk.toml": ('[daemon]\ndisk = "/d"\ndisk_size = "1KiB"\n', ":3: [daemon] disk_size: disk_bytes=1024"),
        "no_max_value.toml": ("[daemon]\nmax_value = 0\n", ":2: [daemon] max_value: max_value_bytes must be >= 1"),
        "inf_heartbeat.toml": ("[daemon]\nheartbeat = inf\n", ":2: [daemon] heartbeat: expected a finite number"),
        "nan_master.toml": ("[master]\nsuspect_after = nan\n", ":2: [master] suspect_after: expected a finite"),
        "short_lease.toml": ("[daemon]\nlease = 0.001\n",
                             ":2: [daemon] lease: must be a finite number of seconds >= 0.05, got 0.001"),
    }
    paths = []
    for name, (text, _) in files.items():
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    p = subprocess.run([*GCACHE, "config", "check", *paths], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    for name, (_, says) in files.items():
        assert f"{tmp_path / name}{says}" in p.stderr, p.stderr
    # the daemon refuses the first file with the same words
    d = subprocess.run([*GCACHE, "daemon", "--config", paths[0]], capture_output=True, text=True, timeout=60,
                       check=False)
    assert d.returncode == 2 and "mem_bytes=5: the RAM tier needs at least 4 KiB" in d.stderr
    assert "Traceback" not in d.stderr


def test_a_real_process_prints_no_traceback(tmp_path):
    """The same through `python -m gcache`, as an operator runs it."""
    for argv, says in ((["put", "k", "--file", str(tmp_path), "--nodes", "127.0.0.1:1"], "Is a directory"),
                       (["daemon", "--frame-timeout", "nan"], "--frame-timeout")):
        p = subprocess.run([*GCACHE, *argv], capture_output=True, text=True, timeout=60, check=False)
        assert p.returncode != 0 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


# -- the daemon's answers to bad metadata -----------------------------------------------------
def frame(op, meta: bytes, payload=b"", req_id=1):
    return struct.pack("<4sBBHQIQ", P.MAGIC, P.VERSION, op, 0, req_id, len(meta), len(payload)) + meta + payload


def reply(sock):
    """(flags, request id, metadata) of the next reply (its payload read and dropped)."""
    return read_reply(sock)[:3]


def test_daemon_names_what_is_wrong_with_metadata_and_a_hello_payload(make_cluster, tmp_path):
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    addr = make_cluster(nodes=1, mem="16MiB", extra_args=["--token-file", str(token), "--no-pretouch"]).addresses[0]
    host, port = addr.rsplit(":", 1)
    hello = msgpack.packb({"token": "t0ken"})
    # before authenticating: a HELLO with a payload is refused for that, and the connection closed
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(frame(P.Op.HELLO, hello, b"junk"))
        flags, _, meta = reply(s)
        assert flags & P.FLAG_ERROR and meta["code"] == P.ErrorCode.BAD_META
        assert meta["msg"] == "HELLO carries no payload, got 4 bytes"
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(frame(P.Op.HELLO, hello))
        assert not reply(s)[0] & P.FLAG_ERROR
        cases = [(b"\xc1\xc1", "not msgpack"), (b"\x91" * 3000 + b"\xc0", "nested too deep"),
                 (msgpack.packb({str(i): i for i in range(100)}), "100 fields in one map, at most 64"),
                 (msgpack.packb({}) + b"\x00\x00", "2 stray bytes after the msgpack map")]
        for i, (raw, says) in enumerate(cases, 2):
            s.sendall(frame(P.Op.GET, raw, req_id=i))
            flags, req_id, meta = reply(s)
            assert req_id == i and meta["code"] == P.ErrorCode.BAD_META
            assert meta["msg"].startswith("undecodable metadata: ") and says in meta["msg"], meta["msg"]
        # authenticated: a HELLO with a payload is refused, its payload drained, the connection kept
        s.sendall(frame(P.Op.HELLO, hello, b"x" * 100, req_id=10) + frame(P.Op.PING, msgpack.packb({}), req_id=11))
        flags, req_id, meta = reply(s)
        assert req_id == 10 and meta["code"] == P.ErrorCode.BAD_META and "no payload" in meta["msg"]
        flags, req_id, meta = reply(s)
        assert req_id == 11 and not flags & P.FLAG_ERROR


def test_argument_checks_accept_the_good_values():
    from gcache import argtypes

    assert argtypes.seconds("0.5") == 0.5 and argtypes.seconds_or_zero("0") == 0.0
    assert argtypes.port("0") == 0 and argtypes.port("65535") == 65535
    assert argtypes.count("1") == 1 and argtypes.count_or_zero("0") == 0
    assert argtypes.size("512MiB") == "512MiB" and argtypes.log_level("debug") == "DEBUG"


def test_a_config_nested_thousands_deep_is_a_syntax_problem_not_a_traceback(tmp_path):
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    p = subprocess.run([*GCACHE, "config", "check", str(deep)], capture_output=True, text=True, timeout=60,
                       check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "nested too deeply" in p.stderr


def test_ctrl_c_in_a_command_is_one_line_not_a_traceback(capsys, monkeypatch):
    from gcache import cli

    def interrupted(args):
        raise KeyboardInterrupt

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd").choices["stats"]
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    sub.set_defaults(fn=interrupted)
    assert cli.main(["stats", "--nodes", "127.0.0.1:1"]) == 130
    err = capsys.readouterr().err
    assert "gcache stats: interrupted" in err and "Traceback" not in err


def test_status_never_prints_a_node_id_raw():
    """Ids from an older master (which took any string) are escaped: a newline forged a row, and
    escape sequences reached the terminal."""
    from gcache.cli import _shown

    assert _shown("node0") == "node0" and _shown("10.0.0.1:7400") == "10.0.0.1:7400"
    for raw in ("a\nnode0      127.0.0.1:7400  UP", "\x1b[2J\x1b[31mred", " ", "t\u00f6"):
        shown = _shown(raw)
        assert "\n" not in shown and "\x1b" not in shown and shown != raw
