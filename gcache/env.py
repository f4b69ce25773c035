"""Where the cluster is and which token it wants: one resolution for every command and library
entry point (the gcache commands, Client, the master and daemon, the SGLang adapter).

Token: ``--token-file`` (or the caller's ``token_file``), then ``$GCACHE_TOKEN_FILE``, then
``$GCACHE_TOKEN``; None when none is set (a cluster without a token).

Cluster: an explicit node list, then explicit masters, then ``$GCACHE_MASTERS``, then
``$GCACHE_NODES``. Masters win over nodes among the environment variables (``gcache up`` exports
both): with masters, routing follows the published membership.
"""

from __future__ import annotations

import os

from gcache.errors import ConfigError

TOKEN_FILE_ENV = "GCACHE_TOKEN_FILE"
TOKEN_ENV = "GCACHE_TOKEN"
MASTERS_ENV = "GCACHE_MASTERS"
NODES_ENV = "GCACHE_NODES"
SCHEME = "gcache://"


def token_error(token: str) -> str | None:
    """Why ``token`` cannot be a cluster token (None: it can): it travels as a gRPC header, so
    printable ASCII (gRPC refuses anything else, and the masters would look down); spaces only
    inside (a token is read stripped)."""
    if not all(" " <= c <= "~" for c in token) or token != token.strip():
        return "a cluster token must be printable ASCII, without spaces at either end (it is sent as a gRPC header)"
    return None


def read_token_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except UnicodeDecodeError:
        raise ConfigError(f"token file {path!r} is not text (a cluster token is printable ASCII)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path!r}: {exc}") from None
    if not token:
        raise ConfigError(f"token file {path!r} is empty")
    if err := token_error(token):
        raise ConfigError(f"token file {path!r}: {err}")
    return token


def resolve_token(token_file: str | None = None) -> str | None:
    """The cluster token: ``token_file``, else $GCACHE_TOKEN_FILE, else $GCACHE_TOKEN."""
    path = token_file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        return read_token_file(path)
    token = os.environ.get(TOKEN_ENV, "").strip() or None
    if token is not None and (err := token_error(token)):
        raise ConfigError(f"${TOKEN_ENV}: {err}")
    return token


def resolve_cluster(nodes: str | list[str] | tuple[str, ...] | None = None,
                    masters: str | None = None) -> str | list[str]:
    """What to hand Client: a ``gcache://`` master URL or a list of daemon HOST:PORT.

    ``nodes`` may itself be a ``gcache://`` URL (taken as masters)."""
    if isinstance(nodes, str):
        if nodes.strip().startswith(SCHEME):
            return nodes.strip()
        nodes = [n.strip() for n in nodes.split(",") if n.strip()]
    if nodes:
        return list(nodes)
    url = masters or os.environ.get(MASTERS_ENV, "").strip()
    if url:
        return url if url.startswith(SCHEME) else SCHEME + url
    listed = [n.strip() for n in os.environ.get(NODES_ENV, "").split(",") if n.strip()]
    if listed:
        return listed
    raise ConfigError(f"no cluster given: pass --nodes HOST:PORT[,...] or --masters gcache://HOST:PORT[,...], "
                      f"or set ${MASTERS_ENV} or ${NODES_ENV}")
