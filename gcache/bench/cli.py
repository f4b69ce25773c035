"""``gcache bench`` argument parsing; the benchmarks are the other modules of gcache.bench.

``gcache bench`` with no subcommand runs ``throughput``, so the core issue's command lines
(``gcache bench --nodes 3 --sizes 64KiB``) keep working. Every benchmark is a subcommand;
the smaller ones (``swa-capacity``, ``store-ops``, ``ucx-check``, ``gpu-check``) also run as
``python -m gcache.bench.<module>``. Results go to ``bench/results`` (relative to the working
directory) unless ``--out`` / ``--json`` say otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from typing import Any

from gcache import argtypes
from gcache.bench import (
    adapter,
    control_report,
    gpu_check,
    instructions,
    request_floor,
    scaling,
    store_ops,
    swa_capacity,
    ucx_check,
)
from gcache.tier.eviction import EvictionKind


def _throughput_args(b: argparse.ArgumentParser) -> None:
    b.add_argument("--nodes", default="3",
                   help="number of local daemons to start (default %(default)s), or HOST:PORT,... of a running cluster")
    b.add_argument("--mem", type=argtypes.size, default="1GiB", help="RAM arena per local daemon (default %(default)s)")
    b.add_argument("--quick", action="store_true",
                   help="the one-minute profile: 64KiB,1MiB,4MiB x batch 16, one thread, put/get, 0.4 s a figure")
    b.add_argument("--sizes", default=None, help="value sizes (default 4KiB..16MiB; --quick: 64KiB,1MiB,4MiB)")
    b.add_argument("--batch", default=None, help="keys per batch, comma-separated (default 16)")
    b.add_argument("--threads", default=None, help="client thread counts (default 1,4; --quick: 1)")
    b.add_argument("--procs", type=argtypes.count, default=1,
                   help="also measure gcache (tcp, local) with this many client processes at once, each "
                        "running --threads threads (default 1: no extra figures)")
    b.add_argument("--ops", default=None, help="put,get,exists (default all three; --quick: put,get)")
    b.add_argument("--seconds", type=argtypes.seconds, default=None,
                   help="time per figure (default 1.0; --quick: 0.4)")
    b.add_argument("--transport", default="tcp",
                   help="gcache transports: tcp,local,ucx; unavailable ones are skipped with the reason "
                        "(default %(default)s)")
    b.add_argument("--peers", default="redis,mooncake",
                   help="peers measured in the same run, or 'none' (default %(default)s; missing ones are "
                        "skipped; `make bench-peers` installs them)")
    b.add_argument("--ceilings", default="socket,memcpy", help="ceilings to measure (default %(default)s)")
    b.add_argument("--out", default=None, metavar="DIR",
                   help="directory for throughput.json/.md and plots (default: beside --json, else bench/results)")
    b.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    b.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")


def _hitrate_args(h: argparse.ArgumentParser) -> None:
    h.add_argument("--trace", default=None,
                   help="Mooncake-format JSONL trace (default ../shared/data/conversation_trace.jsonl)")
    h.add_argument("--limit", type=argtypes.count_or_zero, default=0,
                   help="replay only the first N requests (0 = all)")
    h.add_argument("--nodes", type=argtypes.count, default=3, help="local daemons (default %(default)s)")
    h.add_argument("--page-bytes", default="4KiB",
                   help="bytes of one 512-token block's page, scaled down from the model (default %(default)s)")
    h.add_argument("--capacities", default="0.05,0.1,0.25,0.5,1.0",
                   help="cluster RAM as fractions of the trace's working set (default %(default)s)")
    h.add_argument("--tiers", default="ram,nvme",
                   help="'ram' (RAM only) and/or 'nvme' (RAM + an NVMe tier of --disk-capacity; with both, "
                        "nvme only below capacity 1.0) (default %(default)s)")
    h.add_argument("--disk-capacity", type=argtypes.positive, default=1.25,
                   help="the NVMe tier as a fraction of the working set (default %(default)s)")
    h.add_argument("--policy", default=",".join(k.value for k in EvictionKind),
                   help="eviction policies to compare, comma-separated (default %(default)s); each is run beside "
                        "the trace maximum, a global LRU cache and the offline optimum (Belady)")
    h.add_argument("--engine", default="sim,daemon",
                   help="'sim' (the policy objects simulated, seconds a point) and/or 'daemon' (a real local "
                        "cluster per point and policy) (default %(default)s)")
    h.add_argument("--quick", action="store_true", help="2,000 requests, capacities 0.5,1.25, RAM only")
    h.add_argument("--out", default="bench/results", metavar="DIR",
                   help="directory for hitrate.json/.md and plots (default %(default)s)")
    h.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    h.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    h.add_argument("--no-progress", action="store_true", help="no progress bar")


def _embedding_args(e: argparse.ArgumentParser) -> None:
    e.add_argument("--nodes", default="1", help="local daemons to start (default %(default)s: one, on this host, "
                                                "so the shared-memory path is there), or HOST:PORT,...")
    e.add_argument("--tokens", default="576,1152,2304", help="tokens per embedding (default %(default)s)")
    e.add_argument("--hidden", type=argtypes.count, default=4096,
                   help="hidden size, bf16 values (default %(default)s)")
    e.add_argument("--batch", type=argtypes.count, default=4,
                   help="embeddings per call (default %(default)s)")
    e.add_argument("--runs", type=argtypes.count, default=2,
                   help="page runs each embedding is split into (default %(default)s)")
    e.add_argument("--seconds", type=argtypes.seconds, default=4.0,
                   help="time per figure, store and raw calls alternating (default %(default)s)")
    e.add_argument("--transport", default="local,tcp", help="local,tcp (default %(default)s)")
    e.add_argument("--ops", default="get,put", help="get,put (default %(default)s)")
    e.add_argument("--out", default="bench/results", metavar="DIR", help="directory for embedding.json/.md")
    e.add_argument("--json", default=None, metavar="PATH", help="write the JSON records here")
    e.add_argument("--no-progress", action="store_true", help="no per-figure lines")


def _soak_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--minutes", type=argtypes.positive, default=5.0, help="how long to run, minutes (default %(default)s)")
    s.add_argument("--seconds", type=argtypes.seconds, default=None,
                   help="how long to run, in seconds (overrides --minutes)")
    s.add_argument("--nodes", type=argtypes.count, default=3, help="local daemons (default %(default)s)")
    s.add_argument("--mem", type=argtypes.size, default="2MiB", help="RAM arena per daemon (default %(default)s: small, so values "
                                                 "are evicted and demoted all the time)")
    s.add_argument("--disk", type=argtypes.size, default="32MiB", help="disk tier per daemon (default %(default)s)")
    s.add_argument("--keys", type=argtypes.count, default=2000, help="distinct keys (default %(default)s)")
    s.add_argument("--threads", type=argtypes.count, default=4,
                   help="client threads, alternately TCP and local shared memory (default %(default)s)")
    s.add_argument("--timeout", type=argtypes.seconds, default=5.0,
                   help="client call timeout in seconds (default %(default)s; a small one, e.g. 0.02, makes "
                        "clients give up on requests the daemons are still serving)")
    s.add_argument("--no-kill", action="store_true", help="do not kill -9 and restart a daemon halfway")
    s.add_argument("--seed", type=int, default=1, help="random seed (default %(default)s)")
    s.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON here")


#: subcommand -> (help, argument adder, module whose run_cli(args) runs it)
_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], str]] = {
    "throughput": (("GB/s, keys/s and p50/p99/p999 of gcache, Redis, Mooncake Store, beside the memcpy and "
                   "raw-socket ceilings"), _throughput_args, "gcache.bench.throughput"),
    "hitrate": (("replay a Mooncake-format trace against a local cluster; token hit rate vs capacity, beside "
                "the trace's own maximum"), _hitrate_args, "gcache.bench.hitrate"),
    "embedding": (("multimodal embeddings through the SGLang embedding store beside the raw client moving the "
                  "same bytes (needs sglang)"), _embedding_args, "gcache.bench.embedding"),
    "adapter": (("the SGLang adapter's batch_get_v1 / batch_set_v1 beside the raw client moving the same "
                 "pages, TCP and local (needs sglang)"), adapter.add_arguments, "gcache.bench.adapter"),
    "scaling": (("the client thread / process curve of gcache (tcp) beside Redis and Mooncake: table and "
                 "log-scale plot"), scaling.add_arguments, "gcache.bench.scaling"),
    "soak": (("mixed put/get/delete/overwrite on a local cluster with disks, a daemon killed and restarted "
             "halfway; counts wrong, stale and resurrected values (exit 1 if any)"), _soak_args,
             "gcache.bench.soak"),
    "swa-capacity": (("SWA-aware storage through the SGLang adapter: bytes per cached token and hit rate of "
                     "dual pools vs one pool at a fixed budget (needs sglang)"), swa_capacity.add_arguments,
                     "gcache.bench.swa_capacity"),
    "store-ops": (("per-operation CPU cost of the in-process store (put with eviction, get, exists) for each "
                  "eviction policy"), store_ops.add_arguments, "gcache.bench.store_ops"),
    "instructions": (("CPU instructions per batch on the client and per request in the daemon (callgrind: "
                      "stable on a loaded machine; needs valgrind)"), instructions.add_arguments,
                     "gcache.bench.instructions"),
    "request-floor": (("the daemon's CPU per request beside a minimal Python server's for the same exchange "
                       "(what is gcache's own Python, what any Python server pays)"), request_floor.add_arguments,
                      "gcache.bench.request_floor"),
    "ucx-check": (("UCX (tcp and shared memory) beside plain TCP through gcache.Client, with the memcpy and "
                  "raw TCP ceilings"), ucx_check.add_arguments, "gcache.bench.ucx_check"),
    "gpu-check": (("CUDA tensors through the pinned staging pool beside the device->host copy bandwidth "
                  "(needs a CUDA GPU)"), gpu_check.add_arguments, "gcache.bench.gpu_check"),
    "control-plane": (("real masters under simulated daemons and clients: bootstrap, propagation, heartbeats, "
                      "false DOWN, leader failover"), control_report.add_arguments, "gcache.bench.control_report"),
}


def options_before_subcommand(argv: list[str]) -> str | None:
    """Why ``argv`` (gcache's arguments) must be refused when it gives ``bench`` options before a
    bench subcommand (None: it does not): those are the throughput benchmark's, and the
    subcommand's own defaults silently replaced them (``gcache bench --seconds 1 soak`` ran 300 s)."""
    if "bench" not in argv:
        return None
    rest = argv[argv.index("bench") + 1:]
    sub = next((i for i, a in enumerate(rest) if a in _COMMANDS), None)
    if sub is None:
        return None
    given = [a for a in rest[:sub] if a.startswith("-") and a not in ("-h", "--help")]
    if given:
        return (f"options before the subcommand ({' '.join(given)}) are the throughput benchmark's: put them after "
                f"it (gcache bench {rest[sub]} {' '.join(rest[:sub])} ...)")
    return None


def add_bench_parser(sub: Any) -> None:
    """Add ``bench`` and its subcommands to the ``gcache`` command's subparsers ``sub``."""
    b = sub.add_parser("bench", help="benchmarks: throughput/latency beside ceilings and peers (default), "
                                     "hit-rate replay of a trace, and the others listed below")
    _throughput_args(b)
    b.set_defaults(fn=_runner("gcache.bench.throughput"))
    bsub = b.add_subparsers(dest="bench_cmd", metavar="{" + ",".join(_COMMANDS) + "}")
    for name, (text, add_args, module) in _COMMANDS.items():
        p = bsub.add_parser(name, help=text, description=text)
        add_args(p)
        p.set_defaults(fn=_runner(module))


def output_error(args: argparse.Namespace) -> str | None:
    """Why a bench's ``--out`` (a directory) or ``--json`` (a file) cannot be written, or None."""
    out, path = getattr(args, "out", None), getattr(args, "json", None)
    if out and os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out}: is a file, not a directory"
    if path:
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"--json {path}: is a directory, not a file"
        if os.path.exists(parent) and not os.path.isdir(parent):
            return f"--json {path}: {parent} is a file, not a directory"
    return None


def _runner(module: str) -> Callable[[argparse.Namespace], int]:
    """Runs ``module.run_cli(args)``, importing the module only then (they pull in numpy, torch...)."""

    def run(args: argparse.Namespace) -> int:
        from gcache.mooncake_trace import TraceError

        if err := output_error(args):  # before the measurement, not after it
            raise SystemExit(f"gcache bench: {err}")
        try:
            result: int = importlib.import_module(module).run_cli(args)
        except (TraceError, UnicodeDecodeError) as exc:  # a trace that is not one: its file, line, problem
            raise SystemExit(f"gcache bench: {exc}") from None
        return result

    return run
