"""gcached's data-plane TCP server: one thread per connection, blocking sockets.

Blocking ``recv_into``/``sendmsg`` release the GIL for the copy, so a thread per connection
moves bytes faster than an event loop in Python (FACTS.md: 13 µs vs 46 µs per round trip).
"""

from __future__ import annotations

import logging
import socket
import threading

from gcache.server.admission import Admission, AdmissionConfig, ConnState
from gcache.server.handler import Handler
from gcache.tier.store import Store
from gcache.wire import shutdown_quietly, tune

log = logging.getLogger(__name__)


class DataServer:
    def __init__(self, store: Store, host: str, port: int, node_id: str | None = None,
                 max_payload: int = 4 << 30, token: str | None = None,
                 admission: AdmissionConfig | None = None) -> None:
        self.store = store
        self.max_payload = max_payload
        self.token = token
        self.agent = None  # set by the daemon when it has masters
        # shared with the local server: one connection cap and metadata budget for the daemon
        self.admission = Admission(admission or AdmissionConfig(), token_required=token is not None)
        self._lsock = socket.create_server((host, port), backlog=128)
        self.host, self.port = self._lsock.getsockname()[:2]
        self.address = f"{self.host}:{self.port}"
        self.node_id = node_id or self.address
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.handler_hooks: list = []  # called with each new connection's Handler (gcache.transport.ucx)

    def __repr__(self) -> str:
        return f"DataServer(node={self.node_id!r}, address={self.address!r}, {self.admission!r})"

    def start(self) -> DataServer:
        self._thread = threading.Thread(target=self.serve_forever, name="gcache-accept", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.admission.accept_loop(self._lsock, self._spawn, self._stopped)

    def _spawn(self, sock: socket.socket, state: ConnState) -> None:
        tune(sock)
        threading.Thread(target=self._serve_conn, args=(sock, state), name="gcache-conn", daemon=True).start()

    def _serve_conn(self, sock: socket.socket, state: ConnState) -> None:
        try:
            adm = self.admission
            handler = Handler(sock, self.store, self.node_id, self.max_payload, self.token, self.agent,
                              adm.config, adm.budget, state)
            for hook in self.handler_hooks:
                hook(handler)
            handler.serve()
        finally:
            self.admission.release(state)
            sock.close()

    def stop(self) -> None:
        self._stopped.set()
        shutdown_quietly(self._lsock)
        self._lsock.close()
        self.admission.close_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
