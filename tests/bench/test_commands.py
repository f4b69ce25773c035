"""Every benchmark is a ``gcache bench`` subcommand in gcache.bench; bench/ holds no code."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gcache.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ("throughput", "hitrate", "embedding", "adapter", "scaling", "soak", "swa-capacity", "store-ops",
            "instructions", "request-floor", "ucx-check", "gpu-check", "control-plane")


def bench_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["bench"]


def test_every_benchmark_is_a_subcommand():
    b = bench_parser()
    sub = next(a for a in b._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == COMMANDS
    assert b.parse_args([]).fn.__qualname__ == b.parse_args(["throughput"]).fn.__qualname__


def test_store_ops_runs_in_process_and_as_a_module(capsys):
    args = bench_parser().parse_args(["store-ops", "--puts", "300", "--repeat", "1"])
    assert args.fn(args) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("policy") and len(rows) >= 2 and all(len(r.split()) == 4 for r in rows[1:])
    p = subprocess.run([sys.executable, "-m", "gcache.bench.store_ops", "--puts", "300", "--repeat", "1"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout.startswith("policy"), p.stderr[-2000:]


def test_request_floor_serves_every_request_and_refuses_bad_arguments(capsys):
    """Both servers answer every request of the ping-pong (the client thread would wait for ever
    on a missing reply), and each figure is a positive CPU time per request."""
    from gcache.bench import request_floor

    for op in ("exists", "get"):
        assert request_floor.gcache_us(op, 4, 50) > 0
        assert request_floor.floor_us(op, 4, 50) > 0
    args = bench_parser().parse_args(["request-floor", "--keys", "3", "--requests", "20", "--repeat", "1"])
    assert args.fn(args) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split()[:2] for r in rows[1:]] == [["exists", "3"], ["get", "3"]]
    for bad in (["--ops", "put"], ["--keys", "x"], ["--keys", "0"], ["--requests", "1"]):
        args = bench_parser().parse_args(["request-floor", *bad])
        with pytest.raises(SystemExit, match="gcache bench request-floor: "):
            args.fn(args)


def test_gpu_check_says_when_there_is_no_gpu(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: gpu-check would measure it")
    args = bench_parser().parse_args(["gpu-check"])
    assert args.fn(args) == 2 and "no CUDA device" in capsys.readouterr().err


def test_bench_directory_holds_no_code_and_nothing_edits_sys_path():
    assert not list((ROOT / "bench").glob("*.py"))
    for d in ("gcache", "router", "sglang_adapter"):
        for dirpath, _, files in os.walk(ROOT / d):
            for f in files:
                if f.endswith(".py"):
                    text = (Path(dirpath) / f).read_text()
                    assert "sys.path.insert" not in text and "sys.path.append" not in text, f"{dirpath}/{f}"


def test_bad_bench_input_is_one_line_not_a_traceback(tmp_path):
    """A probe's list: capacities that are not numbers / NaN / inf, a page of 0 bytes, a trace that
    is not JSON, is binary or is empty, bench options before the subcommand (silently replaced by
    the subcommand's defaults: a 1 s soak ran 300 s)."""
    notjson, binary, empty = tmp_path / "notjson.jsonl", tmp_path / "binary.jsonl", tmp_path / "empty.jsonl"
    notjson.write_text("hello\n")
    binary.write_bytes(bytes(range(128, 256)))
    empty.write_text("")
    cases = [
        (["bench", "hitrate", "--capacities", "abc"], "--capacities"),
        (["bench", "hitrate", "--capacities", "nan"], "--capacities"),
        (["bench", "hitrate", "--capacities", "inf"], "--capacities"),
        (["bench", "hitrate", "--page-bytes", "0"], "--page-bytes"),
        (["bench", "hitrate", "--trace", str(notjson), "--engine", "sim"], "not a Mooncake trace record"),
        (["bench", "hitrate", "--trace", str(binary), "--engine", "sim"], "gcache bench:"),
        (["bench", "hitrate", "--trace", str(empty), "--engine", "sim"], "holds no request"),
        (["bench", "--seconds", "1", "soak", "--keys", "50"], "put them after it"),
        (["bench", "soak", "--minutes", "nan"], "--minutes"),
    ]
    for argv, says in cases:
        p = subprocess.run([sys.executable, "-m", "gcache", *argv, "--out", str(tmp_path / "o")]
                           if argv[1] == "hitrate" else [sys.executable, "-m", "gcache", *argv],
                           capture_output=True, text=True, timeout=120, check=False)
        assert p.returncode in (1, 2), (argv, p.returncode, p.stdout[-300:])
        assert "Traceback" not in p.stderr and says in p.stderr, (argv, p.stderr[-500:])
