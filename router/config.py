"""Configuration for the router: frozen dataclasses validated at construction.

Every component takes one of these; nothing reads environment variables. A bad
value raises ``ValueError`` naming the field and what to change.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import ipaddress
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from router.breaker import BreakerConfig
from router.cost import PrefillCost
from router.l3 import L3Config

# Requests one router fleet sends a worker at once before it queues them: the default of
# ``serve`` and of the simulator alike, so simulated results are for the setting users run.
DEFAULT_MAX_INFLIGHT = 64


class StateMode(enum.Enum):
    """Where routing state lives: in this process only, or in Redis (shared by replicas)."""

    MEMORY = "memory"
    REDIS = "redis"


class QueueOrder(enum.Enum):
    """Order in which requests leave the wait queue when every worker is at its limit."""

    FCFS = "fcfs"  # arrival order
    UNCACHED = "uncached"  # fewest estimated uncached tokens first (can starve long prompts)
    AGED = "aged"  # uncached tokens minus aging_tokens_per_s x waiting time (starvation-free)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


_HOSTNAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def check_worker_url(url: object) -> None:
    """A worker URL the proxy can use: ``http://HOST[:PORT][/PATH]``, HOST a DNS name or an IP
    address, PORT 1-65535; PATH is a prefix of every route sent to the worker. Raises ValueError."""
    _check(isinstance(url, str), f"worker url must be a string, got {url!r}")
    assert isinstance(url, str)
    _check(not url.startswith("https://"),
           f"worker url {url!r}: https:// is not supported (the router speaks plain HTTP to workers; "
           "put a TLS-terminating proxy next to the worker, or use http://)")
    _check(url.startswith("http://"), f"worker url must start with http://, got {url!r}")
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError as e:
        raise ValueError(f"worker url {url!r} is not usable: {e}") from None
    host = u.hostname or ""
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"worker url {url!r}: {host!r} is not an IPv6 address") from None
    else:
        _check(_HOSTNAME.fullmatch(host) is not None,
               f"worker url {url!r} needs a host name or IP address (letters, digits, '.', '-', '_')")
    _check(port is None or port > 0, f"worker url {url!r}: port must be 1-65535")
    _check(u.username is None and u.password is None, f"worker url {url!r}: credentials in the URL are not supported")
    _check(not u.query and not u.fragment and "?" not in url and "#" not in url,
           f"worker url {url!r}: no query or fragment; a path prefix is allowed")
    _check(not any(c.isspace() or ord(c) < 0x21 or ord(c) > 0x7e for c in u.path),
           f"worker url {url!r}: the path must be printable ASCII without spaces")


def _where(url: str) -> tuple[str, int, str]:
    """What a (checked) worker URL reaches: host (lower case), port (80 by default), path prefix."""
    u = urlsplit(url)
    return (u.hostname or "").lower(), u.port or 80, u.path.rstrip("/")


def check_workers(workers: Iterable[WorkerSpec], n_buckets: int) -> None:
    """A fleet the router can use: no worker listed twice (same URL), no two workers with the same
    explicit id, every bucket one of the ``n_buckets`` configured."""
    urls: dict[tuple[str, int, str], str] = {}
    ids: dict[str, str] = {}
    for w in workers:
        _check(w.bucket is None or w.bucket < n_buckets,
               f"worker {w.name!r}: bucket {w.bucket} is not one of the {n_buckets} configured (0-{n_buckets - 1})")
        same = _where(w.name)  # http://h, http://h:80 and http://H:080 are one worker
        _check(same not in urls, f"worker {w.name!r} is listed twice"
               + (f" (as {urls[same]!r})" if same in urls and urls[same] != w.name else ""))
        urls[same] = w.name
        if w.id:
            _check(w.id not in ids, f"worker id {w.id!r} is given to both {ids.get(w.id)!r} and {w.name!r}")
            ids[w.id] = w.name


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the routing policies.

    cost: the prefill-time estimate (``router.cost.PrefillCost``) the min_ttft policy and the
        load accounting use; a worker's pending work is kept in these milliseconds.
    inflight_penalty_ms: min_ttft adds this per request already in flight on a worker (the
        decode work interleaved with a new prefill); it also spreads ties toward idle workers.
    affinity_weight, busy_scale_ms: min_ttft charges a spill's redundant prefill
        ``affinity_weight + mean pending ms of the other workers / busy_scale_ms`` times.
    hot_load: a prefix whose warm prefill time is at least this fraction of the interval
        between its requests is hot: it spills as soon as that shortens time to first token.
    balance_abs_threshold / balance_rel_threshold / cache_threshold: the SGLang-style
        gated policy (imbalanced when max-min > abs and max > rel x min, in requests).
    """

    cost: PrefillCost = field(default_factory=PrefillCost)
    inflight_penalty_ms: float = 2.0
    affinity_weight: float = 8.0
    busy_scale_ms: float = 10.0
    hot_load: float = 0.5
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    cache_threshold: float = 0.3

    def __post_init__(self) -> None:
        _check(isinstance(self.cost, PrefillCost), f"cost must be a PrefillCost, got {self.cost!r}")
        _check(self.inflight_penalty_ms >= 0, f"inflight_penalty_ms must be >= 0, got {self.inflight_penalty_ms}")
        _check(self.affinity_weight >= 0, f"affinity_weight must be >= 0, got {self.affinity_weight}")
        _check(self.busy_scale_ms > 0, f"busy_scale_ms must be > 0, got {self.busy_scale_ms}")
        _check(self.hot_load > 0, f"hot_load must be > 0, got {self.hot_load}")
        _check(self.balance_abs_threshold >= 0, "balance_abs_threshold must be >= 0")
        _check(self.balance_rel_threshold >= 1.0, "balance_rel_threshold must be >= 1.0")
        _check(0.0 <= self.cache_threshold <= 1.0, "cache_threshold must be in [0, 1]")


@dataclass(frozen=True)
class QueueConfig:
    """The wait queue used when every eligible worker is at its in-flight limit.

    aging_tokens_per_s: in AGED order a waiting request's key drops by this many
        tokens per second of waiting, so any request eventually reaches the head.
    max_wait_s: a request that waited this long is answered 503 with Retry-After.
    max_depth: more waiting requests than this are refused at once with 503.
    """

    order: QueueOrder = QueueOrder.AGED
    aging_tokens_per_s: float = 4096.0
    max_wait_s: float = 30.0
    max_depth: int = 10_000

    def __post_init__(self) -> None:
        _check(isinstance(self.order, QueueOrder), f"order must be a QueueOrder, got {self.order!r}")
        _check(self.aging_tokens_per_s > 0, "aging_tokens_per_s must be > 0")
        _check(self.max_wait_s > 0, f"max_wait_s must be > 0, got {self.max_wait_s}")
        _check(self.max_depth > 0, f"max_depth must be > 0, got {self.max_depth}")


@dataclass(frozen=True)
class PrefixConfig:
    """The approximate per-worker prefix index.

    block_tokens: tokens per hashed block when the request carries token ids.
    chars_per_token: text prompts are cut into blocks of block_tokens x chars_per_token
        characters, and their token count is estimated as len(text) / chars_per_token.
    max_blocks_per_worker: the index forgets a worker's least recently used blocks beyond this.
    ttl_s: a block not seen for this long is forgotten.
    page_tokens: the engines' KV page size (SGLang ``--page-size``); > 0 turns on page
        hashes: requests with token ids (given, or from ``tokenizer_path``) are hashed per
        page for the exact index fed by engine KV events, and the approximate index keeps
        every (block_tokens / page_tokens)-th page hash. 0 = no exact index.
    tokenizer_path: the workers' tokenizer (tokenizer.json, or a directory with it and
        tokenizer_config.json), so text requests are routed by their real token ids.
    chat_template_path: a Jinja chat template overriding tokenizer_config.json's.
    """

    block_tokens: int = 512
    chars_per_token: int = 4
    max_blocks_per_worker: int = 200_000
    ttl_s: float = 600.0
    page_tokens: int = 0
    tokenizer_path: str | None = None
    chat_template_path: str | None = None

    def __post_init__(self) -> None:
        _check(self.block_tokens > 0, f"block_tokens must be > 0, got {self.block_tokens}")
        _check(self.chars_per_token > 0, f"chars_per_token must be > 0, got {self.chars_per_token}")
        _check(self.max_blocks_per_worker > 0, "max_blocks_per_worker must be > 0")
        _check(self.ttl_s > 0, f"ttl_s must be > 0, got {self.ttl_s}")
        _check(self.page_tokens >= 0, f"page_tokens must be >= 0, got {self.page_tokens}")
        _check(self.page_tokens == 0 or self.block_tokens % self.page_tokens == 0,
               f"block_tokens ({self.block_tokens}) must be a multiple of page_tokens ({self.page_tokens})")
        _check(self.tokenizer_path is None or self.page_tokens > 0,
               "a tokenizer needs page_tokens (the engines' --page-size) to be set")


DEFAULT_BUCKETS: tuple[tuple[int, int], ...] = ((0, 65_536), (65_536, 262_144), (262_144, 1_048_576))


@dataclass(frozen=True)
class BucketConfig:
    """Prompt-length ranges [lo, hi) in tokens; workers are grouped by bucket index.

    A worker with bucket=None serves every length. A request whose bucket has no
    healthy worker falls back to the next larger bucket with one (long-capable
    workers can serve short prompts), then to any worker.
    """

    ranges: tuple[tuple[int, int], ...] = DEFAULT_BUCKETS

    def __post_init__(self) -> None:
        _check(len(self.ranges) > 0, "bucket ranges must not be empty")
        prev_hi = None
        for lo, hi in self.ranges:
            _check(0 <= lo < hi, f"bucket range ({lo}, {hi}) must satisfy 0 <= lo < hi")
            _check(prev_hi is None or lo == prev_hi, f"bucket ranges must be contiguous, gap before {lo}")
            prev_hi = hi

    @staticmethod
    def parse(spec: str) -> BucketConfig:
        """Parse ``"0-64K,64K-256K,256K-1M"``: token counts, K = 1024, M = 1024**2
        (gcache.sizes.parse_tokens)."""
        from gcache.sizes import parse_tokens

        def num(s: str) -> int:
            try:
                return parse_tokens(s)
            except ValueError as exc:
                raise ValueError(f"bad bucket bound: {exc}") from None

        ranges = []
        for part in spec.split(","):
            if "-" not in part:
                raise ValueError(f"bad bucket {part!r}: use LO-HI, e.g. 0-64K")
            lo, hi = part.split("-", 1)
            ranges.append((num(lo), num(hi)))
        return BucketConfig(tuple(ranges))


@dataclass(frozen=True)
class WorkerSpec:
    """One upstream inference server.

    role: "llm" for prefill/decode servers, "encoder" for multimodal encoder servers.
    bucket: index into BucketConfig.ranges, or None to serve every prompt length.
    max_inflight: requests this router fleet sends it at once before queueing.
    speed: prefill throughput relative to the reference worker of the cost model; a worker
        with speed 2 is charged half the time for the same work (the load is per capacity).
    models: the model names it serves (the request's "model" field picks a group); empty =
        any model.
    id: what clients and metrics see instead of the URL; empty = derived (``worker_id``).
    kv_events: the worker's KV event publisher (SGLang ``--kv-events-config`` endpoint, e.g.
        ``tcp://10.0.0.5:5557``); empty = the worker publishes nothing, the approximate index
        stands in. kv_replay: its replay endpoint, if any. kv_topic: its topic.
    """

    url: str
    bucket: int | None = None
    role: str = "llm"
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    speed: float = 1.0
    models: tuple[str, ...] = ()
    id: str = ""
    kv_events: str = ""
    kv_replay: str = ""
    kv_topic: str = ""

    def __post_init__(self) -> None:
        check_worker_url(self.url)
        _check(self.role in ("llm", "encoder"), f"worker role must be 'llm' or 'encoder', got {self.role!r}")
        _check(self.bucket is None or self.bucket >= 0, f"worker bucket must be >= 0, got {self.bucket}")
        _check(self.max_inflight > 0, f"max_inflight must be > 0, got {self.max_inflight}")
        _check(isinstance(self.speed, (int, float)) and math.isfinite(self.speed) and self.speed > 0,
               f"worker speed must be a finite number > 0, got {self.speed}")
        _check(isinstance(self.models, tuple) and all(isinstance(m, str) and m for m in self.models),
               "worker models must be a tuple of non-empty strings")
        _check(isinstance(self.id, str) and len(self.id) <= 64 and "/" not in self.id and ":" not in self.id,
               f"worker id must be a string of at most 64 characters without '/' or ':', got {self.id!r}")

        for name in ("kv_events", "kv_replay"):
            v = getattr(self, name)
            _check(v == "" or v.startswith(("tcp://", "ipc://")), f"worker {name} must be a tcp:// or ipc:// "
                   f"ZMQ endpoint, got {v!r}")

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    @functools.cached_property
    def name(self) -> str:  # computed once: the router reads it several times per request
        return self.url.rstrip("/")

    def to_dict(self) -> dict:
        return {"url": self.name, "bucket": self.bucket, "role": self.role, "max_inflight": self.max_inflight,
                "speed": self.speed, "models": list(self.models), "id": self.id, "kv_events": self.kv_events,
                "kv_replay": self.kv_replay, "kv_topic": self.kv_topic}

    @staticmethod
    def from_dict(d: dict) -> WorkerSpec:
        _check(isinstance(d, dict) and isinstance(d.get("url"), str), "worker must be an object with a string 'url'")
        bucket = d.get("bucket")
        _check(bucket is None or isinstance(bucket, int), "worker 'bucket' must be an integer or null")
        mi = d.get("max_inflight", DEFAULT_MAX_INFLIGHT)
        _check(isinstance(mi, int) and not isinstance(mi, bool), "worker 'max_inflight' must be an integer")
        speed = d.get("speed", 1.0)
        _check(isinstance(speed, (int, float)) and not isinstance(speed, bool), "worker 'speed' must be a number")
        models = d.get("models", [])
        if isinstance(models, str):
            models = [models]
        _check(isinstance(models, list) and all(isinstance(m, str) for m in models),
               "worker 'models' must be a list of model names")
        wid = d.get("id") or ""
        _check(isinstance(wid, str), "worker 'id' must be a string")
        kv = {k: d.get(k) or "" for k in ("kv_events", "kv_replay", "kv_topic")}
        _check(all(isinstance(v, str) for v in kv.values()), "worker kv_events/kv_replay/kv_topic must be strings")
        return WorkerSpec(url=d["url"].rstrip("/"), bucket=bucket, role=str(d.get("role", "llm")), max_inflight=mi,
                          speed=float(speed), models=tuple(models), id=wid, **kv)


@dataclass(frozen=True)
class RouterConfig:
    """Everything one router replica needs. See ``gcache-router serve --help``.

    client_body_timeout_s: a client must deliver a whole request (head and body) within this of its first byte (408).
    upstream_connect_timeout_s: connecting to a worker; a refused, reset or timed-out connect
        never reached the worker and is retried on the next-best one (up to ``retries`` more).
    upstream_first_byte_timeout_s: from sending the request to the worker's response headers
        (a non-streaming answer arrives whole, so this bounds the whole generation) (504).
    upstream_idle_timeout_s: longest silence between two chunks of a response body.
    drain_timeout_s: on SIGTERM / SIGINT, how long requests already taken (in flight or queued)
        may run to their end before the rest are cut; no new connection is accepted meanwhile.
    breaker: per-worker circuit breaker on 5xx answers and timeouts, shared by replicas.
    admin_token: the bearer token of the /admin API; None = the admin API is off (403).
    worker_header: answer with ``X-Gcache-Worker: <worker id>`` (never the URL); off by default.
    worker_id_salt: key of the derived worker ids (empty = the namespace); set a secret one if
        clients must not be able to guess worker addresses from ids.
    l3: the gcache cluster the engines' HiCache writes to (router/l3.py): one batched exists per
        request says how much of its prefix every worker can load instead of recompute.
    """

    policy: str = "min_ttft"
    policy_cfg: PolicyConfig = field(default_factory=PolicyConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    state: StateMode = StateMode.MEMORY
    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "gcache-router"
    max_body_bytes: int = 32 * 1024 * 1024
    client_body_timeout_s: float = 30.0
    upstream_connect_timeout_s: float = 5.0
    upstream_first_byte_timeout_s: float = 600.0
    upstream_idle_timeout_s: float = 120.0
    drain_timeout_s: float = 25.0
    retries: int = 2
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    admin_token: str | None = None
    worker_header: bool = False
    worker_id_salt: str = ""
    l3: L3Config | None = None
    health_interval_s: float = 2.0
    health_failures: int = 2
    redis_timeout_s: float = 0.5

    def __post_init__(self) -> None:
        _check(isinstance(self.state, StateMode), f"state must be a StateMode, got {self.state!r}")
        _check(self.max_body_bytes > 0, "max_body_bytes must be > 0")
        for name in ("client_body_timeout_s", "upstream_connect_timeout_s", "upstream_first_byte_timeout_s",
                     "upstream_idle_timeout_s"):
            _check(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        _check(self.drain_timeout_s >= 0, f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        _check(self.retries >= 0, f"retries must be >= 0, got {self.retries}")
        _check(self.l3 is None or self.prefix.page_tokens > 0,
               "L3 awareness needs the engines' page size (page_tokens, --page-size)")
        _check(self.admin_token is None or len(self.admin_token) >= 16,
               "admin_token must be at least 16 characters (or None to turn the admin API off)")
        _check(self.health_interval_s > 0, "health_interval_s must be > 0")
        _check(self.health_failures >= 1, "health_failures must be >= 1")
        _check(self.redis_timeout_s > 0, "redis_timeout_s must be > 0")
        _check(bool(self.namespace) and ":" not in self.namespace, "namespace must be non-empty, without ':'")


def worker_id(spec: WorkerSpec, salt: str) -> str:
    """The id clients and metrics see: the spec's own, else a keyed hash of its URL."""
    if spec.id:
        return spec.id
    return "w-" + hashlib.blake2b(spec.name.encode(), key=salt.encode()[:64], digest_size=6).hexdigest()
