"""Data-plane transports beside plain TCP (which lives in gcache.client / gcache.server).

``Transport`` is what ``gcache.Client(transport=...)`` takes; importing this package loads no
transport library (``gcache.transport.ucx`` imports ucxx only when it is used).
"""

from __future__ import annotations

import enum


class Transport(enum.Enum):
    """How a client reaches daemons: TCP (the default; the local shared-memory path still applies
    to daemons on this host) or UCX (the same protocol carried by UCX tag messages, after a
    worker-address exchange over the TCP data-plane connection; daemons need ``--ucx``)."""

    TCP = "tcp"
    UCX = "ucx"
