"""``gcache bench request-floor``: the daemon's CPU per request beside the floor of any Python
server doing the same exchange, in the same harness.

Both sides serve a socketpair in this process's main thread while a second thread sends
requests one at a time and waits for each reply (ping-pong, as a client's batch does), and
both are timed by the serving thread's CPU clock (``time.thread_time``: system calls, wake-ups
and the GIL hand-offs included, other jobs on the machine not):

* ``gcache``: gcache.server.handler.Handler over a Store holding the keys (frames, metadata
  checks, the store lock, the eviction policy's bookkeeping, the reply);
* ``floor``: the least a Python server can do for it: one ``recv_into``, ``msgpack`` in, a dict
  probe per key, ``msgpack`` out, one ``sendmsg``.

What is left between the two is gcache's own Python per request; what the floor costs is the
part no rewrite of the handler in Python can remove (and a native one only partly: the system
calls and wake-ups stay).

    gcache bench request-floor --ops exists,get --keys 5,16
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

import msgpack

from gcache import argtypes

VALUE = 4096


def _pingpong(serve: Callable[[socket.socket], int], send: Callable[[socket.socket], None], n: int) -> float:
    """Microseconds of the serving thread's CPU per request over ``n`` requests."""
    a, b = socket.socketpair()
    a.settimeout(30)  # a server or client that stops answering fails the figure, it does not hang it
    b.settimeout(30)
    try:
        def client() -> None:
            try:
                for _ in range(n):
                    send(b)
            finally:
                b.shutdown(socket.SHUT_RDWR)

        t = threading.Thread(target=client, daemon=True)
        t.start()
        t0 = time.thread_time()
        served = serve(a)
        spent = time.thread_time() - t0
        t.join(30)
        return 1e6 * spent / max(1, served)
    finally:
        a.close()
        b.close()


def gcache_us(op: str, nkeys: int, n: int) -> float:
    """The daemon's handler: CPU per request of ``op`` over ``nkeys`` stored keys."""
    from gcache.net.stream import SocketStream
    from gcache.protocol import Op
    from gcache.server.handler import Handler, ServerContext
    from gcache.tier.store import Store, StoreConfig
    from gcache.transport.connection import Connection

    store = Store(StoreConfig(mem_bytes=64 << 20, pretouch=False))
    keys = [b"k%d" % i for i in range(nkeys)]
    val = os.urandom(VALUE)
    for k in keys:
        store.put(("default", k), val)
    served = [0]

    def serve(sock: socket.socket) -> int:
        handler = Handler(SocketStream(sock), ServerContext(store, "n0", 1 << 30, None))
        handler.serve()
        return served[0]

    conns: dict[int, Connection] = {}

    def send(sock: socket.socket) -> None:
        conn = conns.get(sock.fileno())
        if conn is None:
            conn = conns[sock.fileno()] = Connection("n0", "pair", SocketStream(sock), 60.0)
        dl = time.monotonic() + 60
        conn.send(Op.EXISTS if op == "exists" else Op.GET, {"ns": "default", "keys": keys}, [], dl, 60)
        _meta, plen = conn.recv_reply(dl)
        conn.discard(plen, dl)
        served[0] += 1

    try:
        return _pingpong(serve, send, n)
    finally:
        store.close()


def floor_us(op: str, nkeys: int, n: int) -> float:
    """A minimal Python server for the same request: CPU per request."""
    keys = [b"k%d" % i for i in range(nkeys)]
    values = {("default", k): os.urandom(VALUE) for k in keys}
    req = msgpack.packb({"ns": "default", "keys": keys})
    frame = struct.pack("<I", len(req)) + req
    rbuf = bytearray(1 << 20)

    def send(sock: socket.socket) -> None:
        sock.sendall(frame)
        need, got = None, 0
        while need is None or got < need:
            got += sock.recv_into(memoryview(rbuf)[got:])
            if need is None and got >= 4:
                need = 4 + struct.unpack_from("<I", rbuf)[0]

    def serve(sock: socket.socket) -> int:
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        done = 0
        while True:
            got = sock.recv_into(buf)
            if not got:
                return done
            m = msgpack.unpackb(view[4:got])
            ns = m["ns"]
            if op == "exists":
                st = [(ns, k) in values for k in m["keys"]]
                parts = [msgpack.packb({"st": st})]
            else:
                hits = [values.get((ns, k)) for k in m["keys"]]
                parts = [msgpack.packb({"st": [h is not None for h in hits],
                                        "sz": [len(h) if h else 0 for h in hits]})]
                parts += [h for h in hits if h]
            body = sum(map(len, parts))
            sock.sendmsg([struct.pack("<I", body), *parts])
            done += 1

    return _pingpong(serve, send, n)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default="exists,get", help="exists and/or get (default %(default)s)")
    p.add_argument("--keys", default="5,16", help="keys per request, comma-separated (default %(default)s; "
                                                   "5 is one owner's share of a batch of 16 over 3 daemons)")
    p.add_argument("--requests", type=argtypes.count, default=5000, help="requests per figure (default %(default)s)")
    p.add_argument("--repeat", type=argtypes.count, default=3, help="runs per figure, the best kept (default %(default)s)")


def run_cli(args: argparse.Namespace) -> int:
    ops = [o for o in args.ops.split(",") if o]
    if not ops or any(o not in ("exists", "get") for o in ops):
        raise SystemExit(f"gcache bench request-floor: --ops takes exists and/or get, got {args.ops!r}")
    try:
        counts = [int(k) for k in args.keys.split(",")]
    except ValueError:
        raise SystemExit(f"gcache bench request-floor: --keys takes integers, got {args.keys!r}") from None
    if not counts or min(counts) < 1 or args.requests < 10 or args.repeat < 1:
        raise SystemExit("gcache bench request-floor: need --keys >= 1, --requests >= 10, --repeat >= 1")
    print(f"{'op':<7} {'keys':>4}  {'gcache us':>9}  {'floor us':>8}  {'gcache - floor':>14}  (serving thread CPU "
          f"per request, best of {args.repeat})")
    for op in ops:
        for k in counts:
            g = min(gcache_us(op, k, args.requests) for _ in range(args.repeat))
            f = min(floor_us(op, k, args.requests) for _ in range(args.repeat))
            print(f"{op:<7} {k:>4}  {g:9.1f}  {f:8.1f}  {g - f:14.1f}", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gcache.bench.request_floor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_cli(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
