"""``gcache-router``: run the router (``serve``) or the trace simulator (``sim``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from router.bench import run as bench_run
from router.breaker import BreakerConfig
from router.config import (
    BucketConfig,
    PolicyConfig,
    PrefixConfig,
    QueueConfig,
    QueueOrder,
    RouterConfig,
    StateMode,
    WorkerSpec,
)
from router.l3 import L3Config
from router.policies import POLICIES
from router.sim import cli as sim_cli


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="an upstream worker, repeatable: URL or URL,bucket=N,role=encoder,max_inflight=N,speed=X,"
                        "models=NAME|NAME,id=NAME,kv_events=tcp://HOST:PORT,kv_replay=tcp://HOST:PORT")
    p.add_argument("--config", metavar="FILE",
                   help='JSON file: {"workers": [{"url": ..., "bucket": 0, "role": "llm", "max_inflight": 64}]}, '
                        "or a gcache.toml (FILE.toml) whose [router] section gives these flags' defaults "
                        "(--worker flags add to its workers)")
    p.add_argument("--policy", choices=sorted(POLICIES), default=RouterConfig().policy,
                   help="routing policy (default: %(default)s)")
    p.add_argument("--state", choices=[m.value for m in StateMode], default="memory",
                   help="memory: one replica, no Redis; redis: stateless replicas sharing --redis")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL for --state redis")
    p.add_argument("--namespace", default="gcache-router", help="Redis key prefix shared by replicas of one fleet")
    p.add_argument("--queue-order", choices=[q.value for q in QueueOrder], default="aged",
                   help="order of the wait queue (default: aged)")
    p.add_argument("--aging", type=float, default=QueueConfig().aging_tokens_per_s,
                   help="aged order: tokens of priority gained per second waited (default: %(default)s)")
    p.add_argument("--max-wait", type=float, default=QueueConfig().max_wait_s,
                   help="seconds a request may wait for a slot before a 503 (default: %(default)s)")
    p.add_argument("--max-queue", type=_positive_int, default=QueueConfig().max_depth, metavar="N",
                   help="requests that may wait for a slot per wait queue (one per length bucket and model); "
                        "more are refused at once with 503 + Retry-After (default: %(default)s)")
    p.add_argument("--buckets", default="0-64K,64K-256K,256K-1M",
                   help="prompt-length ranges for worker groups (default: %(default)s)")
    p.add_argument("--block-tokens", type=int, default=PrefixConfig().block_tokens,
                   help="tokens per hashed prefix block (default: %(default)s)")
    p.add_argument("--page-size", type=int, default=0,
                   help="the engines' KV page size (SGLang --page-size); turns on page hashing and the exact "
                        "index fed by workers' KV events (kv_events=); 0 = off (default)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="the workers' tokenizer.json (or a directory with it and tokenizer_config.json): route "
                        "text by its real token ids; needs --page-size")
    p.add_argument("--chat-template", metavar="FILE", help="Jinja chat template (default: tokenizer_config.json's)")
    p.add_argument("--l3-nodes", metavar="NODES",
                   help="the gcache cluster the engines' HiCache writes to (HOST:PORT,... or gcache://MASTERS): "
                        "one batched exists per request tells how much of its prefix any worker can load; "
                        "needs --page-size and --l3-shard")
    p.add_argument("--l3-shard", default="", help="the engines' KV shard: the part of their page keys after '@', shard and page "
                        "format, as the gcache HiCache backend logs it at its first batch "
                        "(e.g. Qwen%%2FQwen3-8B_tp0of1#9f2c...)")
    p.add_argument("--l3-namespace", default="sglang", help="gcache namespace of the engines (default: sglang)")
    p.add_argument("--l3-timeout", type=float, default=0.05,
                   help="seconds a request waits for the L3 answer before treating it as a miss (default: 0.05)")
    p.add_argument("--inflight-penalty-ms", type=float, default=PolicyConfig().inflight_penalty_ms,
                   help="min_ttft: estimated ms added per request already in flight on a worker "
                        "(default: %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=32, help="largest request body accepted (default: 32)")
    p.add_argument("--health-interval", type=float, default=2.0, help="seconds between health checks")
    d = RouterConfig()
    p.add_argument("--body-timeout", type=float, default=d.client_body_timeout_s,
                   help="seconds a client has to send a whole request, head and body, from its first byte (408 after; default: %(default)s)")
    p.add_argument("--connect-timeout", type=float, default=d.upstream_connect_timeout_s,
                   help="seconds to connect to a worker (default: %(default)s)")
    p.add_argument("--first-byte-timeout", type=float, default=d.upstream_first_byte_timeout_s,
                   help="seconds until a worker's response headers (default: %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=d.upstream_idle_timeout_s,
                   help="longest silence in seconds between two chunks of a response (default: %(default)s)")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="on SIGTERM, seconds the requests already taken (in flight or queued) may run to their "
                        "end; no new connection is accepted meanwhile (default: %(default)s)")
    p.add_argument("--retries", type=int, default=d.retries,
                   help="other workers to try when the chosen one was never reached (default: %(default)s)")
    p.add_argument("--breaker-failures", type=int, default=d.breaker.failures,
                   help="consecutive failures that open a worker's circuit (default: %(default)s)")
    p.add_argument("--breaker-open", type=float, default=d.breaker.open_s,
                   help="seconds an open circuit keeps requests away (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="file holding the bearer token of the /admin API (16+ characters); without it the "
                        "admin API is off")
    p.add_argument("--worker-header", action="store_true",
                   help="answer with X-Gcache-Worker: <worker id> (never the worker's URL); off by default")
    p.add_argument("--worker-id-salt", default="",
                   help="key of the derived worker ids (default: the namespace); set a secret one so clients "
                        "cannot guess worker addresses from ids")
    p.add_argument("--access-log", action="store_true",
                   help="log every request at INFO (method, path, status, ms); off by default, it costs "
                        "throughput")


def _positive_int(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {v!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a whole number > 0, got {v!r}")
    return n


def parse_worker(arg: str) -> WorkerSpec:
    url, *opts = arg.split(",")
    d: dict = {"url": url}
    for o in opts:
        k, _, v = o.partition("=")
        if k in ("bucket", "max_inflight"):
            try:
                d[k] = int(v)
            except ValueError:
                raise ValueError(f"worker option {k} needs an integer, got {v!r}") from None
        elif k == "speed":
            try:
                d[k] = float(v)
            except ValueError:
                raise ValueError(f"worker option speed needs a number, got {v!r}") from None
        elif k == "models":
            d[k] = [m for m in v.split("|") if m]
        elif k in ("role", "id", "kv_events", "kv_replay", "kv_topic"):
            d[k] = v
        else:
            raise ValueError(f"unknown worker option {k!r} in {arg!r}; use bucket=, role=, max_inflight=, speed=, models=, id=, "
                         "kv_events=, kv_replay=, kv_topic=")
    return WorkerSpec.from_dict(d)


def config_from_args(a: argparse.Namespace) -> tuple[RouterConfig, list[WorkerSpec]]:
    workers = [parse_worker(w) for w in a.worker]
    token = None
    if a.admin_token_file:
        with open(a.admin_token_file, encoding="utf-8") as f:
            token = f.read().strip()
    if a.config:
        with open(a.config, encoding="utf-8") as f:
            doc = json.load(f)
        workers += [WorkerSpec.from_dict(w) for w in doc.get("workers", [])]
    cfg = RouterConfig(
        policy=a.policy,
        policy_cfg=PolicyConfig(inflight_penalty_ms=a.inflight_penalty_ms),
        queue=QueueConfig(order=QueueOrder(a.queue_order), aging_tokens_per_s=a.aging, max_wait_s=a.max_wait,
                          max_depth=a.max_queue),
        prefix=PrefixConfig(block_tokens=a.block_tokens, page_tokens=a.page_size, tokenizer_path=a.tokenizer,
                            chat_template_path=a.chat_template),
        buckets=BucketConfig.parse(a.buckets),
        state=StateMode(a.state),
        redis_url=a.redis,
        namespace=a.namespace,
        max_body_bytes=int(a.max_body_mb * 1024 * 1024),
        health_interval_s=a.health_interval,
        client_body_timeout_s=a.body_timeout,
        upstream_connect_timeout_s=a.connect_timeout,
        upstream_first_byte_timeout_s=a.first_byte_timeout,
        upstream_idle_timeout_s=a.idle_timeout,
        drain_timeout_s=a.drain_timeout,
        retries=a.retries,
        breaker=BreakerConfig(a.breaker_failures, a.breaker_open),
        admin_token=token,
        l3=(L3Config(tuple(n for n in a.l3_nodes.split(",") if n) if not a.l3_nodes.startswith("gcache://")
                     else (a.l3_nodes,), a.l3_shard, a.l3_namespace, a.l3_timeout) if a.l3_nodes else None),
        worker_header=a.worker_header,
        worker_id_salt=a.worker_id_salt,
    )
    return cfg, workers


def serve(a: argparse.Namespace) -> int:
    from router.proxy import build_app, run

    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg, workers = config_from_args(a)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        app = build_app(cfg, workers)
    except ValueError as e:  # a tokenizer or chat template that does not load, workers that clash
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.access_log:
        app.router.access_log = logging.getLogger("gcache.router.access")
    run(app, a.host, a.port, on_listening=lambda where: print(f"gcache-router listening on {where}", flush=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gcache-router",
        description="Cache-aware LLM request router (serve) and its trace-driven simulator (sim).",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    ps = sub.add_parser("serve", help="run the HTTP router in front of inference workers",
                        description="Reverse proxy for /v1/completions, /v1/chat/completions and /generate "
                                    "that routes each request to the worker most likely to hold its prefix.")
    _serve_args(ps)
    pm = sub.add_parser("sim", help="replay a Mooncake trace against simulated workers",
                        description="Deterministic discrete-event simulation of every policy x queue order.")
    sim_cli.add_arguments(pm)
    from router.sim import multimodal

    pmm = sub.add_parser("mmsim", help="multimodal encoder-cache hit rate: round-robin vs consistent hashing",
                         description="Zipf image trace replayed on encoders with fixed-size embedding caches.")
    multimodal.add_arguments(pmm)
    pb = sub.add_parser("bench", help="measure the router's overhead against an echo worker",
                        description="Echo worker direct vs through the router (memory and Redis state), "
                                    "same client, same run: throughput, latency, streaming time to first byte.")
    bench_run.add_arguments(pb)
    argv = sys.argv[1:] if argv is None else list(argv)
    toml = _toml_config(argv) if argv[:1] == ["serve"] else None
    if toml:  # a gcache.toml (--config FILE.toml or $GCACHE_CONFIG): [router] gives the flags' defaults
        from gcache.errors import ConfigError
        from gcache.ops.config import apply_defaults, defaults_for, load

        try:
            apply_defaults(ps, defaults_for(load(toml), "router"))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    a = parser.parse_args(argv)
    if toml and a.cmd == "serve" and a.config == toml:
        a.config = None  # already applied; not the JSON worker list
    return {"serve": serve, "sim": sim_cli.run, "mmsim": multimodal.run, "bench": bench_run.run}[a.cmd](a)


def _toml_config(argv: list[str]) -> str | None:
    from gcache.ops.config import config_path

    path = config_path(argv)
    return path if path and path.endswith(".toml") else None
