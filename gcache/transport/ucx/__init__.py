"""The data-plane protocol over UCX (ucxx from PyPI), selected with ``Client(transport=Transport.UCX)``
and ``gcache daemon --ucx``. ``setup`` holds the UCX context, workers and endpoints and both
ends' connection set-up; ``stream`` the Stream over one endpoint. The daemon's UCX_CONNECT op
is served by gcache.server.ucx_op.

Connection set-up reuses the daemon's TCP data-plane connection, so nothing listens on any other
interface (ucxx's listener API binds every interface): the client connects over TCP (HELLO with
the token as usual), sends UCX_CONNECT ``{"addr": its worker address, "cid": connection id}``;
the daemon creates a UCX worker for this connection, an endpoint to the client's worker, and
answers with its own worker address; the client creates its endpoint back. From then on frames
flow as UCX tag messages (tags ``2*cid`` client->daemon, ``2*cid+1`` daemon->client): the header
and metadata as one message, each payload buffer as its own, received straight into its
destination (the arena slot on the daemon, the caller's buffer on the client).

The TCP connection stays open, idle, as the liveness channel: either side closing it (or dying,
or the daemon stopping) wakes the other side's waits, which UCX itself would not report with
endpoint error handling off (required for shared-memory-only endpoints: UCX refuses error
handling on them with "Destination is unreachable").

Both sides see a Stream (:class:`UcxStream`, gcache.net.stream), so the daemon's Handler and the
client's Connection run unchanged over it. A message larger than the
bytes asked for (the receiver reads the 28-byte header first, then the metadata) is received into
a staging buffer and handed out in pieces; payload messages land in place. Each connection owns
its own UCX worker (one thread uses it at a time), progressed in blocking mode: progress, arm,
then poll the worker's event fd together with the TCP socket.
"""

from __future__ import annotations

from gcache.transport.ucx.setup import accept, available, dial
from gcache.transport.ucx.stream import UcxStream

__all__ = ["UcxStream", "accept", "available", "dial"]
