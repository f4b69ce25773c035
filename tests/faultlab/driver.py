"""The lab's client: a process inside the client host's namespace, driven over stdin/stdout.

``python -m tests.faultlab.driver --masters gcache://... --token-file F --timeout 0.5``

Reads one JSON command per line and answers one JSON line (see ``Driver.handle``). Besides
single calls it runs a checked load: a writer puts and deletes keys with ever-increasing
versions, a reader reads them back, and every hit is checked against what had been
acknowledged before the read began:

* wrong: the bytes are not exactly a value that was written for that key;
* stale: the version is older than the newest put or delete acknowledged before the read
  started (a resurrected delete counts here too).

A value newer than the last acknowledgement (a write still in flight, or one that failed
after reaching the daemon) is fine, and so is a miss: a cache may forget, never lie.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from typing import Any

from gcache import Client, OnNodeError, Status
from gcache import protocol as P
from gcache.errors import GCacheError, ServerError
from gcache.meta.master_client import MasterClient
from gcache.meta.rpc import load_token
from gcache.transport import open_connection


def make_value(key: str, version: int, size: int) -> bytes:
    head = f"{key}|{version}|".encode()
    return (head * (size // len(head) + 1))[:max(size, len(head))]


def parse_version(key: str, value: bytes, size: int) -> int | None:
    """The version a value carries, or None if it is not exactly a value written for ``key``."""
    parts = bytes(value).split(b"|", 2)
    if len(parts) < 3 or parts[0] != key.encode() or not parts[1].isdigit():
        return None
    version = int(parts[1])
    return version if bytes(value) == make_value(key, version, size) else None


class Load:
    def __init__(self, masters: str, token: str | None, timeout_s: float, keys: int, size: int,
                 delete_ratio: float, batch: int) -> None:
        self.keys = [f"k{i}" for i in range(keys)]
        self.size, self.delete_ratio, self.batch = size, delete_ratio, batch
        self.floor: dict[str, int] = {}  # key -> newest acknowledged version (put or delete)
        self.next_version = 1
        self.lock = threading.Lock()
        self.stats: dict[str, Any] = {k: 0 for k in (
            "reads", "read_keys", "hits", "misses", "unavailable", "stale", "wrong", "puts_ok", "puts_failed",
            "deletes_ok", "deletes_failed", "errors")}
        self.stats.update(max_read_s=0.0, max_write_s=0.0, violations=[], error_samples=[])
        self._stop = threading.Event()
        self.writer_client = Client(masters, token=token, timeout_s=timeout_s, on_node_error=OnNodeError.MISS)
        self.reader_client = Client(masters, token=token, timeout_s=timeout_s, on_node_error=OnNodeError.MISS)
        self.threads = [threading.Thread(target=self._guard, args=(fn,), daemon=True)
                        for fn in (self._write_loop, self._read_loop)]

    def start(self) -> Load:
        # every key starts with an acknowledged value
        for i in range(0, len(self.keys), self.batch):
            self._write(self.keys[i:i + self.batch], delete=False)
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for t in self.threads:
            t.join(timeout=10)
        self.writer_client.close()
        self.reader_client.close()
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return json.loads(json.dumps(self.stats))

    def _guard(self, fn) -> None:
        while not self._stop.is_set():
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - counted and reported, the load goes on
                with self.lock:
                    self.stats["errors"] += 1
                    if len(self.stats["error_samples"]) < 5:
                        self.stats["error_samples"].append(repr(exc))
                time.sleep(0.01)

    def _write(self, keys: list[str], delete: bool) -> None:
        with self.lock:
            versions = list(range(self.next_version, self.next_version + len(keys)))
            self.next_version += len(keys)
        t0 = time.monotonic()
        if delete:  # OK (it was there) and NOT_FOUND are both acknowledgements; the rest are not
            st = self.writer_client.delete_status(keys)
            acked = [s in (Status.OK, Status.NOT_FOUND) for s in st]
        else:
            st = self.writer_client.put(keys, [make_value(k, v, self.size) for k, v in zip(keys, versions)])
            acked = [s is Status.OK for s in st]
        took = time.monotonic() - t0
        with self.lock:
            self.stats["max_write_s"] = max(self.stats["max_write_s"], took)
            kind = "deletes" if delete else "puts"
            for k, v, ok in zip(keys, versions, acked):
                self.stats[f"{kind}_{'ok' if ok else 'failed'}"] += 1
                if ok:
                    self.floor[k] = max(self.floor.get(k, 0), v)

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            keys = random.sample(self.keys, self.batch)
            self._write(keys, delete=random.random() < self.delete_ratio)

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            keys = random.sample(self.keys, self.batch)
            with self.lock:
                floors = [self.floor.get(k, 0) for k in keys]
            t0 = time.monotonic()
            got = self.reader_client.get(keys)
            took = time.monotonic() - t0
            with self.lock:
                s = self.stats
                s["reads"] += 1
                s["read_keys"] += len(keys)
                s["max_read_s"] = max(s["max_read_s"], took)
                for k, floor, g in zip(keys, floors, got):
                    if g is None:
                        s["misses"] += 1
                        continue
                    s["hits"] += 1
                    v = parse_version(k, g, self.size)
                    if v is None:
                        s["wrong"] += 1
                        self._violation(f"wrong bytes for {k}: {bytes(g[:40])!r}")
                    elif v < floor:
                        s["stale"] += 1
                        self._violation(f"stale {k}: read version {v}, acknowledged {floor} before the read")

    def _violation(self, what: str) -> None:
        if len(self.stats["violations"]) < 10:
            self.stats["violations"].append(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {what}")


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.masters = args.masters
        self.token = load_token(args.token_file)
        self.timeout_s = args.timeout
        self.client = Client(self.masters, token=self.token, timeout_s=self.timeout_s,
                             on_node_error=OnNodeError.MISS)
        self.load: Load | None = None

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["cmd"]
        if op == "start":
            self.load = Load(self.masters, self.token, self.timeout_s, cmd.get("keys", 200), cmd.get("size", 256),
                             cmd.get("delete_ratio", 0.1), cmd.get("batch", 16)).start()
            return {"ok": True}
        if op == "stats":
            return self.load.snapshot() if self.load else {}
        if op == "stop":
            out = self.load.stop() if self.load else {}
            self.load = None
            return out
        if op == "get":
            t0 = time.monotonic()
            got = self.client.get(cmd["keys"])
            return {"vals": [None if g is None else bytes(g).decode("latin-1") for g in got],
                    "elapsed": time.monotonic() - t0}
        if op == "put":
            st = self.client.put(cmd["keys"], [v.encode("latin-1") for v in cmd["values"]])
            return {"st": [s.name for s in st]}
        if op == "owners":
            return {"owners": self.client.owners(cmd["keys"]), "epoch": self.client.membership.epoch}
        if op == "status":
            return self._status(cmd["master"])
        if op == "drain":
            return self._master_call(cmd["master"], "Drain", {"node": cmd["node"]})
        if op == "raw":
            return self._raw(cmd["address"], cmd.get("keys", ["k0"]), cmd.get("timeout", 0.3))
        if op == "bench":
            return self._bench(cmd.get("seconds", 2.0), cmd.get("size", 64 << 10), cmd.get("batch", 16))
        raise ValueError(f"unknown command {op!r}")

    def _status(self, address: str) -> dict[str, Any]:
        return self._master_call(address, "Status", {})

    def _master_call(self, address: str, method: str, args: dict[str, Any]) -> dict[str, Any]:
        mc = MasterClient([address], self.token, timeout_s=0.5)
        try:
            return mc.call(method, args, timeout_s=0.5)
        except GCacheError as exc:
            return {"error": str(exc)}
        finally:
            mc.close()

    def _raw(self, address: str, keys: list[str], timeout: float) -> dict[str, Any]:
        """One GET straight to one daemon, on a fresh connection: is it serving?"""
        conn = None
        deadline = time.monotonic() + timeout
        try:
            conn = open_connection(address, address, timeout, self.token)
            conn.send(P.Op.GET, {"ns": "default", "keys": [k.encode() for k in keys]}, [], deadline, timeout)
            meta, plen = conn.recv_reply(deadline)
            conn.discard(plen, deadline)
            return {"served": True, "ep": meta.get("ep"), "st": meta.get("st")}
        except ServerError as exc:
            return {"served": False, "code": int(exc.code), "fenced": exc.code == P.ErrorCode.FENCED}
        except GCacheError as exc:
            return {"served": False, "transport": repr(exc)}
        finally:
            if conn is not None:
                conn.close()

    def _bench(self, seconds: float, size: int, batch: int) -> dict[str, Any]:
        keys = [f"bench{i}" for i in range(batch)]
        vals = [bytes([i % 251]) * size for i in range(batch)]
        out: dict[str, Any] = {}
        for phase in ("put", "get"):
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < seconds:
                if phase == "put":
                    ok = sum(s is Status.OK for s in self.client.put(keys, vals))
                else:
                    ok = sum(g is not None and len(g) == size for g in self.client.get(keys))
                n += ok
            took = time.monotonic() - t0
            out[f"{phase}_MBps"] = n * size / took / 1e6
            out[f"{phase}_ops"] = n / took
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--masters", required=True)
    p.add_argument("--token-file", required=True)
    p.add_argument("--timeout", type=float, default=0.5)
    driver = Driver(p.parse_args())
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            break
        try:
            out = driver.handle(cmd)
        except Exception as exc:  # noqa: BLE001 - reported to the test, the driver goes on
            out = {"exception": repr(exc)}
        print(json.dumps(out), flush=True)
    if driver.load is not None:
        driver.load.stop()
    driver.client.close()


if __name__ == "__main__":
    main()
