"""``gcache bench instructions``: callgrind counts, per batch, from two runs of different length."""

import json
import shutil

import pytest

from gcache.bench import instructions
from tests.bench.test_commands import bench_parser


def test_counts_come_from_the_totals_line_and_the_difference_of_two_runs(tmp_path):
    f = tmp_path / "cg.out-01"
    f.write_text("version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nfn=(1) main\n5 100\ntotals: 123456789\n")
    assert instructions.counted(str(f)) == 123_456_789
    (tmp_path / "empty").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no totals line"):
        instructions.counted(str(tmp_path / "empty"))
    assert instructions.per_batch(1_000_000, 1_500_000, 100, 200) == 5_000
    with pytest.raises(ValueError):
        instructions.per_batch(1, 2, 200, 200)


@pytest.mark.parametrize("argv", [["--ops", "scan"], ["--side", "server"], ["--batch", "0"], ["--batch", "a,b"],
                                  ["--batches", "2"]])
def test_bad_arguments_are_refused_with_a_message(argv):
    args = bench_parser().parse_args(["instructions", *argv])
    with pytest.raises(SystemExit, match="gcache bench instructions: "):
        args.fn(args)


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind (Debian package valgrind)")
@pytest.mark.timeout(600)  # Python under callgrind starts ~50x slower: 30-120 s here, more on a busy machine
def test_the_daemon_side_is_counted_under_callgrind(tmp_path):
    """A short real run: the handler's instructions per EXISTS of 4 keys, written as a record."""
    out = tmp_path / "ic.json"
    args = bench_parser().parse_args(["instructions", "--side", "daemon", "--ops", "exists", "--batch", "4",
                                      "--batches", "40", "--json", str(out)])
    assert args.fn(args) == 0
    rec, = json.loads(out.read_text())["records"]
    assert rec["side"] == "daemon" and rec["op"] == "exists" and rec["batch"] == 4
    # a request is tens of thousands of instructions of Python, nowhere near zero or a start-up's worth
    assert 10_000 < rec["instructions"] < 5_000_000 and rec["native"] == instructions.NATIVE
