"""The client's settings: one frozen, validated object (``Client(nodes, ClientConfig(...))``)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from gcache.env import token_error
from gcache.errors import ConfigError, GCacheError
from gcache.protocol import namespace_error
from gcache.transport import Transport


class LocalPath(enum.Enum):
    """The shared-memory path to a daemon on this host: AUTO uses it when the daemon offers it
    (else TCP), OFF never, FORCE always (failing when it is not available)."""

    AUTO = "auto"
    OFF = "off"
    FORCE = "force"


class OnNodeError(enum.Enum):
    """What a batch does when an owning node fails: RAISE the typed error after the other
    owners have answered, or report its keys as UNAVAILABLE (gets and exists become misses)."""

    RAISE = "raise"
    MISS = "miss"


#: the longest timeout a client accepts (a day: poll() and select() take at most ~24.8 days)
MAX_TIMEOUT_S = 86400.0


def timeout_error(name: str, value: object) -> str | None:
    """Why ``value`` is not a timeout in seconds (None if it is one): a number, not a bool, > 0
    and at most MAX_TIMEOUT_S (inf and huge values overflow every wait; NaN never compares)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        return f"{name} must be a finite number of seconds > 0 and at most {MAX_TIMEOUT_S:g}, got {value!r}"
    return None


@dataclass(frozen=True)
class ClientConfig:
    """``namespace``: the default namespace of every call. ``timeout_s``: a whole batch's
    deadline; ``connect_timeout_s``: one connection's (an owner that does not answer costs its
    own keys this much). ``token``: the cluster token (None: gcache.env.resolve_token(), i.e.
    $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN). ``local``: the shared-memory path to daemons on
    this host. ``max_idle_per_node``: pooled connections kept per daemon. ``split_bytes`` /
    ``split_keys``: a large batch for one owner goes out as several requests of at most this
    many bytes (puts) or keys (other ops), in flight at once. ``local_min_bytes``: over the local
    path, a request carries its values over the Unix socket (one round trip) unless it moves at
    least this many bytes per extra round trip of copying through the mapped arena instead (a get's
    lease costs one, a put's two: LALLOC, LCOMMIT); 0 always copies through the arena. ``transport``: TCP, UCX (daemons
    run with ``--ucx``; UCX brings its own shared memory, so the local path is off; the UCX_*
    environment picks UCX's transports) or MEMORY (in-process daemons, for tests).
    ``on_failure``: with ``on_node_error=MISS``, called in the calling thread with each owner's
    failure in a batch (its keys answered as misses / UNAVAILABLE), so a caller that must not
    raise can still log and count why (a wrong token, an unreachable daemon)."""

    namespace: str = "default"
    timeout_s: float = 2.0
    connect_timeout_s: float = 0.5
    on_node_error: OnNodeError = OnNodeError.RAISE
    token: str | None = None
    local: LocalPath = LocalPath.AUTO
    max_idle_per_node: int = 8
    split_bytes: int = 4 << 20
    split_keys: int = 64
    local_min_bytes: int = 256 << 10
    transport: Transport = Transport.TCP
    on_failure: Callable[[GCacheError], None] | None = None

    def __post_init__(self) -> None:
        err = namespace_error(self.namespace)
        if err:
            raise ConfigError(err)
        for name in ("timeout_s", "connect_timeout_s"):
            err = timeout_error(name, getattr(self, name))
            if err:
                raise ConfigError(err)
        if self.token is not None and (err := token_error(self.token)):
            raise ConfigError(f"token: {err}")
        if self.split_bytes < 1 or self.split_keys < 1:
            raise ConfigError("split_bytes and split_keys must be >= 1")
        if self.max_idle_per_node < 0:
            raise ConfigError("max_idle_per_node must be >= 0")
        if self.local_min_bytes < 0:
            raise ConfigError("local_min_bytes must be >= 0")
        for name, kind in (("on_node_error", OnNodeError), ("local", LocalPath), ("transport", Transport)):
            value = getattr(self, name)
            if not isinstance(value, kind):  # accept the enum's value ("miss", "tcp", ...) too
                try:
                    object.__setattr__(self, name, kind(value))
                except ValueError:
                    raise ConfigError(f"{name}: {value!r} is not one of {[k.value for k in kind]}") from None
        if self.transport is not Transport.TCP and self.local is LocalPath.FORCE:
            raise ConfigError("local=FORCE needs transport=TCP (UCX brings its own shared memory)")

    @property
    def local_path(self) -> LocalPath:
        """The local path as it applies: only TCP clients have one."""
        return self.local if self.transport is Transport.TCP else LocalPath.OFF
