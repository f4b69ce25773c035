"""``/healthz`` and ``/readyz`` beside ``/metrics`` on a daemon's or master's metrics port.

* live (``/healthz``): the process answers and its serving thread runs. A failing liveness
  probe means "restart me".
* ready (``/readyz``): it should get traffic. A daemon is ready when it is registered with the
  masters (or runs without them), not fenced, not drained away, and its RAM arena is mapped; a
  master when its Raft group has a leader.

Both answer 200 or 503 with a JSON body ``{"ok": bool, "checks": {name: {"ok": bool, "detail": str}}}``.
"""

from __future__ import annotations

import argparse
import json
import socketserver
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from gcache import argtypes

Check = tuple[bool, str]
Probe = Callable[[], dict[str, Check]]


def add_arguments(p: argparse.ArgumentParser, with_port: bool) -> None:
    if with_port:
        p.add_argument("--metrics-port", type=argtypes.port, default=None, metavar="PORT",
                       help="serve /metrics, /healthz and /readyz on METRICS_HOST:PORT (0 picks a free port; "
                            "default off); the address is written to READY_FILE.metrics")
    p.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics/health port binds (default %(default)s; the host's address for "
                        "Prometheus and kubelet probes)")


def report(probe: Probe) -> dict[str, Any]:
    try:
        checks = probe()
    except Exception as exc:  # noqa: BLE001 (a probe that breaks is a failed probe, not a dead endpoint)
        checks = {"probe": (False, f"{type(exc).__name__}: {exc}")}
    return {"ok": all(ok for ok, _ in checks.values()),
            "checks": {k: {"ok": ok, "detail": d} for k, (ok, d) in checks.items()}}


MAX_CONNECTIONS = 64  # scrapes and probes served at once; more wait in the listen queue
READ_TIMEOUT_S = 10.0  # a connection that sends no request (or half of one) for this long is closed


class _Threading(socketserver.ThreadingMixIn, WSGIServer):
    """One thread per connection, at most MAX_CONNECTIONS at once (a slowloris of 50 idle
    connections held 50 threads for good; the listen queue held 5)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(timeout=READ_TIMEOUT_S):
            self.shutdown_request(request)  # every slot held that long: this one is dropped
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # per read: a connection that stops sending is closed

    def log_message(self, *args: Any) -> None:
        pass


class HealthServer:
    """An HTTP server: /metrics from ``registry``, /healthz and /readyz from the probes."""

    def __init__(self, registry: CollectorRegistry, live: Probe, ready: Probe, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        metrics_app = make_wsgi_app(registry)
        probes = {"/healthz": live, "/readyz": ready}

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            probe = probes.get(environ.get("PATH_INFO", ""))
            if probe is None:
                return metrics_app(environ, start_response)
            body = report(probe)
            start_response("200 OK" if body["ok"] else "503 Service Unavailable",
                           [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]

        self._server = make_server(host, port, app, server_class=_Threading, handler_class=_Quiet)
        self.address = f"{host}:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="gcache-health", daemon=True)
        self._thread.start()

    # the interface RequestMetrics.stop() expects of its server
    def shutdown(self) -> None:
        self._server.shutdown()

    def server_close(self) -> None:
        self._server.server_close()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


# -- daemon ---------------------------------------------------------------------------------
def daemon_probes(server: Any, store: Any, agent: Any) -> tuple[Probe, Probe]:
    def live() -> dict[str, Check]:
        t = getattr(server, "_thread", None)
        return {"serving": (t is not None and t.is_alive(), f"data plane on {server.address}")}

    def ready() -> dict[str, Check]:
        mm = getattr(store.arena, "_mmap", None)
        checks = {**live(), "arena": (mm is not None and not mm.closed, f"{store.arena.size} bytes mapped")}
        if agent is None:
            checks["registered"] = (True, "static cluster (no masters)")
            return checks
        registered = agent.wait_registered(0)
        checks["registered"] = (registered, f"incarnation {agent.inc} at epoch {agent.epoch}" if registered
                                else "not registered with any master")
        checks["not_fenced"] = (not agent.fenced, "serving" if not agent.fenced else "fenced: no heartbeat round")
        checks["member"] = (not agent.left, "in the ring" if not agent.left else "drained: left the cluster")
        return checks

    return live, ready


def serve_daemon(metrics: Any, server: Any, store: Any, agent: Any, port: int, host: str) -> str:
    """Serve the daemon's metrics registry with the health probes, attached to ``metrics`` (so
    ``metrics.stop()`` stops it and ``metrics.address`` says where it is)."""
    live, ready = daemon_probes(server, store, agent)
    hs = HealthServer(metrics.registry, live, ready, host, port)
    metrics.attach(hs, hs.address)
    return hs.address


# -- master ---------------------------------------------------------------------------------
def master_probes(master: Any) -> tuple[Probe, Probe]:
    """``master``: a gcache.meta.master.Master (its gRPC front; Raft and the node table live in
    its core process, asked through ``master.health()``)."""

    def live() -> dict[str, Check]:
        return {"serving": (master.serving, f"gRPC on {master.address}")}

    def ready() -> dict[str, Check]:
        checks = live()
        if not checks["serving"][0]:
            return checks
        st = master.health()["raft"]
        leader = st.get("leader")
        return {**checks, "leader": (leader is not None,
                                     f"leader {leader} (term {st.get('term')})" if leader else "no Raft leader")}

    return live, ready


def serve_master(master: Any, port: int, host: str) -> HealthServer:
    from gcache.ops.master_metrics import MasterCollector

    registry = CollectorRegistry()
    registry.register(MasterCollector(master))
    live, ready = master_probes(master)
    return HealthServer(registry, live, ready, host, port)
