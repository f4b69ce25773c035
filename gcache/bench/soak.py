"""``gcache bench soak``: mixed puts, gets, deletes and overwrites against a local cluster with
disks, each hit checked against the last acknowledged write; one daemon is killed (-9) and
restarted in the middle.

The arenas are small beside the working set, so eviction, demotion to disk, promotion and
segment reclamation run all the time. Threads alternate between TCP and the local
shared-memory path. Every key has one writer thread (so its writes are ordered) and is read
by all. A value carries its key, the write's id (per key, increasing) and a checksum, so a hit
is classified exactly:

* **wrong**: bytes that are not a value written to this key (torn, corrupt, another key's);
* **stale**: an older value of the key, when a newer put had been acknowledged before the
  read was sent;
* **resurrected**: a value (or ``exists`` = True) when the last acknowledged operation on the
  key before the read was a delete.

A value whose write was not acknowledged (the node failed, the call timed out) may appear
until a later operation on the key is acknowledged: the request may have been applied, but not
after its client gave up on it (a daemon drops a write whose connection was reset, see
docs/faults.md), and the key's writer issues its next operation only then. A refused write
(FULL) is known not to have happened. A miss is always allowed.
"""

from __future__ import annotations

import math
import os
import random
import struct
import threading
import time
from dataclasses import asdict, dataclass, field

import xxhash

from gcache.client.client import Client, LocalPath, OnNodeError
from gcache.cluster import LocalCluster
from gcache.errors import GCacheError
from gcache.protocol import Status

HEAD = struct.Struct("<4sIQQ")  # magic, key id, write id, xxh3 of (key id, write id, payload)
MAGIC = b"SOAK"
PUT, DEL = 1, 2
UNKNOWN_PUT = (Status.UNAVAILABLE, Status.ERROR)  # the request may or may not have been applied


@dataclass(frozen=True)
class SoakConfig:
    """seconds: run length; nodes/mem/disk: the local cluster (arena per daemon small beside
    keys x average value size, so values move between RAM and disk all the time); keys: how
    many distinct keys, of which the first ``hot`` get ``hot_share`` of all operations (so threads
race on the same keys); max_value: largest value (sizes are uniform from 64 bytes); threads:
    client threads (even ones use TCP, odd ones the local shared-memory path); kill_at: the
    fraction of the run at which daemon 1 is killed with SIGKILL, restarted ``down_s`` later
    (None: no kill); root: the cluster's directory (default: a temporary one)."""

    seconds: float = 300.0
    nodes: int = 3
    mem: str = "2MiB"
    disk: str = "32MiB"
    keys: int = 2000
    hot: int = 128
    hot_share: float = 0.8
    max_value: int = 128 << 10
    threads: int = 4
    kill_at: float | None = 0.5
    down_s: float = 2.0
    root: str | None = None
    seed: int = 1
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not (0 < self.seconds < math.inf) or self.threads < 1 or self.keys < self.threads \
                or self.max_value < HEAD.size + 1:
            raise ValueError("soak needs a finite run length > 0, threads >= 1, keys >= threads, max_value > 24 "
                             "bytes")
        if self.timeout_s <= 0:
            raise ValueError("soak needs a timeout > 0 seconds")
        if self.kill_at is not None and (not 0 < self.kill_at < 1 or self.nodes < 2):
            raise ValueError("kill_at is a fraction of the run in (0, 1), and needs at least 2 nodes")


@dataclass
class SoakReport:
    seconds: float = 0.0
    ops: int = 0  # per-key operations
    hits: int = 0
    misses: int = 0
    wrong: int = 0
    stale: int = 0
    resurrected: int = 0
    puts_acked: int = 0
    puts_unknown: int = 0
    puts_refused: int = 0
    deletes_acked: int = 0
    deletes_unknown: int = 0
    read_errors: int = 0
    restarted: bool = False
    evictions: int = 0
    demotions: int = 0
    disk_hits: int = 0
    promotions: int = 0
    promotions_dropped: int = 0
    segments_reclaimed: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Nothing wrong, stale or resurrected, in a run that did check something (a run that
        acknowledged no put checked nothing: not a pass)."""
        return self.wrong == self.stale == self.resurrected == 0 and self.ops > 0 and self.puts_acked > 0

    def add(self, other: SoakReport) -> None:
        for k, v in asdict(other).items():
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(self, k, getattr(self, k) + v)
        self.examples += other.examples[: max(0, 10 - len(self.examples))]

    def table(self) -> str:
        rows = [("ops", self.ops), ("hits", self.hits), ("misses", self.misses), ("wrong", self.wrong),
                ("stale", self.stale), ("resurrected", self.resurrected)]
        detail = (f"{self.seconds:.0f} s; puts acked {self.puts_acked}, unknown {self.puts_unknown}, refused "
                  f"{self.puts_refused}; deletes acked {self.deletes_acked}, unknown {self.deletes_unknown}; "
                  f"failed reads {self.read_errors}; kill -9 + restart: {'yes' if self.restarted else 'no'}; "
                  f"daemons: {self.evictions} evictions, {self.demotions} demotions, {self.disk_hits} disk hits, "
                  f"{self.promotions} promotions ({self.promotions_dropped} dropped: deleted while read), "
                  f"{self.segments_reclaimed} disk segments reclaimed")
        lines = ["| " + " | ".join(n for n, _ in rows) + " |", "|" + "---:|" * len(rows),
                 "| " + " | ".join(str(v) for _, v in rows) + " |", "", detail]
        lines += [f"  e.g. {e}" for e in self.examples]
        return "\n".join(lines)


class KeyStates:
    """What each key may hold: its last acknowledged operation (write id, PUT/DEL), the last
    write id issued, and write ids whose outcome is unknown."""

    def __init__(self, n: int) -> None:
        self.acked = [(0, DEL)] * n  # nothing stored yet: like a delete
        self.issued = [0] * n
        self.unknown: list[set[int]] = [set() for _ in range(n)]

    def verdict(self, k: int, wid: int, seen: tuple[int, int]) -> str | None:
        """None if a value with write id ``wid`` may be read for key ``k`` by a read sent when
        the last acknowledged operation was ``seen``; else 'stale' or 'resurrected'. A write
        with an unknown outcome counts only while it is newer than that operation."""
        lo, kind = seen
        if wid > lo or (wid == lo and kind == PUT):
            return None
        return "stale" if kind == PUT else "resurrected"


def make_value(k: int, wid: int, size: int) -> bytes:
    payload = os.urandom(max(size - HEAD.size, 1))
    chk = xxhash.xxh3_64_intdigest(struct.pack("<IQ", k, wid) + payload)
    return HEAD.pack(MAGIC, k, wid, chk) + payload


def parse_value(k: int, v: bytes | bytearray) -> int | None:
    """The write id of a value that is intact and belongs to key ``k``, else None."""
    if len(v) <= HEAD.size:
        return None
    magic, kid, wid, chk = HEAD.unpack_from(v)
    if magic != MAGIC or kid != k:
        return None
    if xxhash.xxh3_64_intdigest(struct.pack("<IQ", k, wid) + bytes(v[HEAD.size:])) != chk:
        return None
    return wid


def key_name(k: int) -> str:
    return f"soak-{k}"


class Worker:
    def __init__(self, t: int, cfg: SoakConfig, states: KeyStates, addresses: list[str]) -> None:
        self.t, self.cfg, self.states = t, cfg, states
        self.rng = random.Random(cfg.seed * 1000 + t)
        self.own = list(range(t, cfg.keys, cfg.threads))
        self.own_hot = [k for k in self.own if k < cfg.hot] or self.own
        self.hot = list(range(min(cfg.hot, cfg.keys)))
        self.report = SoakReport()
        # even threads: TCP; odd ones the local path, every copy through the arena (t % 4 == 1)
        # or small requests inline over its Unix socket (t % 4 == 3)
        self.client = Client(addresses, timeout_s=cfg.timeout_s, on_node_error=OnNodeError.MISS,
                             local=LocalPath.OFF if t % 2 == 0 else LocalPath.FORCE,
                             local_min_bytes=0 if t % 4 == 1 else 256 << 10)

    def run(self, until: float, stop: threading.Event | None = None) -> None:
        try:
            while time.monotonic() < until and not (stop is not None and stop.is_set()):
                r, hot = self.rng.random(), self.rng.random() < self.cfg.hot_share
                every = self.hot if hot else range(self.cfg.keys)
                own = self.own_hot if hot else self.own
                if r < 0.45:
                    self.read(self.rng.sample(every, min(len(every), self.rng.randint(1, 8))))
                elif r < 0.55:
                    self.exists(self.rng.sample(every, min(len(every), self.rng.randint(1, 8))))
                elif r < 0.88:
                    self.put(self.rng.sample(own, min(len(own), self.rng.randint(1, 4))))
                else:
                    self.delete(self.rng.sample(own, min(len(own), self.rng.randint(1, 3))))
        finally:
            self.client.close()

    def _bad(self, what: str, k: int, detail: str) -> None:
        setattr(self.report, what, getattr(self.report, what) + 1)
        if len(self.report.examples) < 10:
            self.report.examples.append(f"{what}: key {k} {detail}")

    def read(self, keys: list[int]) -> None:
        st = self.states
        seen = [st.acked[k] for k in keys]
        try:
            got = self.client.get([key_name(k) for k in keys])
        except GCacheError:
            self.report.read_errors += len(keys)
            return
        self.report.ops += len(keys)
        for k, v, s in zip(keys, got, seen):
            if v is None:
                self.report.misses += 1
                continue
            self.report.hits += 1
            wid = parse_value(k, v)
            if wid is None:
                self._bad("wrong", k, f"{len(v)} bytes that are no value written to it")
                continue
            verdict = st.verdict(k, wid, s)
            if verdict:
                self._bad(verdict, k, f"returned write {wid} after write/delete {s[0]} was acknowledged")

    def exists(self, keys: list[int]) -> None:
        st = self.states
        seen = [(st.acked[k], st.issued[k], bool(st.unknown[k])) for k in keys]
        try:
            there = self.client.exists([key_name(k) for k in keys])
        except GCacheError:
            self.report.read_errors += len(keys)
            return
        self.report.ops += len(keys)
        for k, yes, ((lo, kind), issued, unknown) in zip(keys, there, seen):
            # nothing may be stored if a delete was the last acknowledged operation, no write
            # was in flight when we asked, none started since, and none has an unknown outcome
            if yes and kind == DEL and issued == lo and st.issued[k] == lo and not unknown:
                self._bad("resurrected", k, f"exists after delete {lo} was acknowledged")

    def put(self, keys: list[int]) -> None:
        st = self.states
        wids = []
        for k in keys:
            st.issued[k] += 1
            wids.append(st.issued[k])
        values = [make_value(k, w, self.rng.randint(64, self.cfg.max_value)) for k, w in zip(keys, wids)]
        try:
            status = self.client.put([key_name(k) for k in keys], values)
        except GCacheError:
            status = [Status.UNAVAILABLE] * len(keys)
        self.report.ops += len(keys)
        for k, w, s in zip(keys, wids, status):
            if s is Status.OK:
                st.acked[k] = (w, PUT)
                self.report.puts_acked += 1
            elif s in UNKNOWN_PUT:
                st.unknown[k].add(w)
                self.report.puts_unknown += 1
            else:
                self.report.puts_refused += 1  # FULL / TOO_LARGE: not stored, the old value stands

    def delete(self, keys: list[int]) -> None:
        st = self.states
        wids = []
        for k in keys:
            st.issued[k] += 1
            wids.append(st.issued[k])
        try:
            # the per-key statuses (Client.delete folds UNAVAILABLE into False)
            status = self.client.delete_status([key_name(k) for k in keys])
        except GCacheError:
            status = [Status.UNAVAILABLE] * len(keys)
        self.report.ops += len(keys)
        for k, w, s in zip(keys, wids, status):
            if s in (Status.OK, Status.NOT_FOUND):  # answered: the delete happened
                st.acked[k] = (w, DEL)
                self.report.deletes_acked += 1
            else:
                self.report.deletes_unknown += 1


def _daemon_totals(addresses: list[str], report: SoakReport) -> None:
    with Client(addresses, on_node_error=OnNodeError.MISS) as c:
        for s in c.stats().values():
            report.evictions += int(s.get("evictions", 0))
            report.demotions += int(s.get("demotions", 0))
            report.disk_hits += int(s.get("hits_nvme", 0))
            report.promotions += int(s.get("promotions", 0))
            report.promotions_dropped += int(s.get("promotions_dropped", 0))
            report.segments_reclaimed += int(s.get("disk_reclaimed_segments", 0))


def run_cli(args) -> int:
    """``gcache bench soak``: run, print the table, exit 1 if anything wrong, stale or resurrected."""
    import json

    seconds = args.seconds if args.seconds is not None else args.minutes * 60
    try:
        cfg = SoakConfig(seconds=seconds, nodes=args.nodes, mem=args.mem, disk=args.disk, keys=args.keys,
                         threads=args.threads, kill_at=None if args.no_kill else 0.5, seed=args.seed,
                         timeout_s=args.timeout)
    except ValueError as exc:
        hint = " (or --no-kill)" if args.nodes < 2 and not args.no_kill else ""
        raise SystemExit(f"gcache bench soak: {exc}{hint}") from None
    print(f"soak: {cfg.nodes} daemons (arena {cfg.mem}, disk {cfg.disk}), {cfg.keys} keys of up to "
          f"{cfg.max_value} bytes, {cfg.threads} threads (TCP and local), timeout {cfg.timeout_s} s, {seconds:.0f} s",
          flush=True)
    report = run_soak(cfg, progress=True)
    print(report.table())
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "report": asdict(report)}, f, indent=1)
    print("OK: nothing wrong, stale or resurrected" if report.ok else "FAILED: see the counts above")
    return 0 if report.ok else 1


def run_soak(cfg: SoakConfig, progress: bool = False) -> SoakReport:
    cluster = LocalCluster(nodes=cfg.nodes, mem=cfg.mem, disk=cfg.disk, root=cfg.root)
    cluster.start()
    report = SoakReport()
    try:
        states = KeyStates(cfg.keys)
        workers = [Worker(t, cfg, states, cluster.addresses) for t in range(cfg.threads)]
        t0 = time.monotonic()
        until = t0 + cfg.seconds
        stop = threading.Event()  # Ctrl-C: the workers end with their current operation
        threads = [threading.Thread(target=w.run, args=(until, stop), name=f"soak-{w.t}", daemon=True)
                   for w in workers]
        for th in threads:
            th.start()
        try:
            _run_phase(cfg, cluster, report, t0, progress, threads)
        except BaseException:
            stop.set()
            for th in threads:
                th.join(timeout=max(1.0, cfg.timeout_s + 1))
            raise
        for w in workers:
            report.add(w.report)
        final = Worker(cfg.threads, cfg, states, cluster.addresses)  # a last sweep over every key
        for i in range(0, cfg.keys, 64):
            final.read(list(range(i, min(i + 64, cfg.keys))))
        final.client.close()
        report.add(final.report)
        report.seconds = time.monotonic() - t0
        _daemon_totals(cluster.addresses, report)
    finally:
        cluster.stop()
    return report


def _run_phase(cfg: SoakConfig, cluster: LocalCluster, report: SoakReport, t0: float, progress: bool,
               threads: list[threading.Thread]) -> None:
    """The run itself: the kill -9 and restart halfway, then the workers' end (join() in short
    waits: a Ctrl-C is seen at once)."""
    if cfg.kill_at is not None:
        time.sleep(max(0.0, t0 + cfg.kill_at * cfg.seconds - time.monotonic()))
        if progress:
            print(f"[{time.monotonic() - t0:5.1f} s] kill -9 {cluster.daemons[1].node_id}", flush=True)
        cluster.kill(1)
        time.sleep(cfg.down_s)
        cluster.restart(1)
        report.restarted = True
        if progress:
            print(f"[{time.monotonic() - t0:5.1f} s] {cluster.daemons[1].node_id} restarted", flush=True)
    for th in threads:
        while th.is_alive():
            th.join(timeout=0.2)
