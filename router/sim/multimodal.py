"""Multimodal encoder-cache simulation: does routing by media hash raise the encoders' hit rate?

A trace generator draws requests that carry 1-4 images, each image picked from a catalog with a
Zipf popularity (rank k drawn with probability proportional to 1 / k**s), so popular images recur
across requests. Each of ``encoders`` encoder servers keeps an LRU cache of ``capacity``
embeddings (its own host pool; fixed, the same for every policy). A request goes to one encoder,
which looks up every image of the request in its cache (a miss runs the vision encoder and
caches the result). Placement policies:

* ``round_robin``: request i to encoder i mod N (what a load balancer without affinity does);
* ``consistent_hash``: the owner of the request's first media key on router.encoder.EncoderRing,
  exactly as the router's encoder affinity places it;
* ``ch_bounded``: consistent hashing with bounded load: when the owner took more than
  (1 + eps) x its share of the last ``window`` requests, the least loaded encoder of that window
  instead (the router falls back the same way when an owner is saturated);
* ``ch_per_image``: every image of a request encoded by its own owner on the ring (a router that
  splits a request's images across encoders; the bound of what affinity can do).

The trace's ceiling (every lookup but the first of each image hits) is what a cache shared by
all encoders without a size limit would reach, such as gcache's global embedding store.

Everything is deterministic for a seed. ``gcache-router mmsim`` runs a capacity sweep.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

from router.encoder import EncoderRing

POLICIES = ("round_robin", "consistent_hash", "ch_bounded", "ch_per_image")


@dataclass(frozen=True)
class MMTraceConfig:
    requests: int = 50_000
    images: int = 20_000  # catalog size
    zipf_s: float = 0.8
    per_request: tuple[float, ...] = (0.7, 0.2, 0.05, 0.05)  # P(1 image), P(2), P(3), P(4)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.images < 1:
            raise ValueError("requests and images must be >= 1")
        if self.zipf_s < 0:
            raise ValueError("zipf_s must be >= 0")
        if not self.per_request or min(self.per_request) < 0 or abs(sum(self.per_request) - 1) > 1e-9:
            raise ValueError("per_request: probabilities of 1, 2, ... images, summing to 1")


def media_key(image: int) -> str:
    """The media hash a request carries for catalog image ``image`` (hex, like a content hash)."""
    return xxhash.xxh3_128_hexdigest(f"image-{image}".encode())


def generate(cfg: MMTraceConfig) -> list[tuple[str, ...]]:
    """Requests, each the tuple of its images' media keys (distinct within a request)."""
    rng = np.random.default_rng(cfg.seed)
    weights = 1.0 / np.arange(1, cfg.images + 1, dtype=np.float64) ** cfg.zipf_s
    cdf = np.cumsum(weights / weights.sum())
    counts = rng.choice(np.arange(1, len(cfg.per_request) + 1), size=cfg.requests, p=cfg.per_request)
    draws = np.minimum(np.searchsorted(cdf, rng.random(int(counts.sum())), side="right"), cfg.images - 1)
    keys = [media_key(i) for i in range(cfg.images)]
    out, at = [], 0
    for n in counts:
        out.append(tuple(dict.fromkeys(keys[i] for i in draws[at:at + n])))
        at += n
    return out


#: (request index, its media keys) -> the encoder of each image
Placement = Callable[[int, tuple[str, ...]], list[int]]


def round_robin(encoders: int) -> Placement:
    return lambda i, media: [i % encoders] * len(media)


def _owner(encoders: int) -> Callable[[str], int]:
    names = [f"encoder{e}" for e in range(encoders)]
    ring = EncoderRing(names)
    index = {n: e for e, n in enumerate(names)}
    return lambda key: index[ring.owner(key)]


def consistent_hash(encoders: int) -> Placement:
    owner = _owner(encoders)
    return lambda i, media: [owner(media[0])] * len(media)


def ch_per_image(encoders: int) -> Placement:
    owner = _owner(encoders)
    return lambda i, media: [owner(k) for k in media]


def ch_bounded(encoders: int, eps: float = 0.5, window: int = 0) -> Placement:
    """Consistent hashing unless the owner took more than (1 + eps) / N of the last ``window``
    requests (default 16 N); then the least loaded encoder of the window."""
    owner = _owner(encoders)
    window = window or 16 * encoders
    recent: deque[int] = deque()
    load = [0] * encoders

    def place(i: int, media: tuple[str, ...]) -> list[int]:
        e = owner(media[0])
        if len(recent) >= window // 2 and load[e] > (1 + eps) * len(recent) / encoders:
            e = min(range(encoders), key=lambda k: (load[k], k))
        recent.append(e)
        load[e] += 1
        if len(recent) > window:
            load[recent.popleft()] -= 1
        return [e] * len(media)

    return place


def make_placement(policy: str, encoders: int) -> Placement:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {POLICIES}")
    return {"round_robin": round_robin, "consistent_hash": consistent_hash, "ch_bounded": ch_bounded,
            "ch_per_image": ch_per_image}[policy](encoders)


@dataclass
class MMResult:
    policy: str
    encoders: int
    capacity: int  # embeddings each encoder caches
    requests: int
    images: int  # image lookups
    hits: int
    hit_rate: float
    load_imbalance: float  # busiest encoder's image lookups / the mean


def simulate(requests: Sequence[tuple[str, ...]], encoders: int, capacity: int, place: Placement,
             policy: str = "") -> MMResult:
    """Replay ``requests`` on ``encoders`` LRU caches of ``capacity`` embeddings each."""
    if encoders < 1 or capacity < 0:
        raise ValueError("encoders must be >= 1 and capacity >= 0")
    caches: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(encoders)]
    load = [0] * encoders
    hits = lookups = 0
    for i, media in enumerate(requests):
        for key, e in zip(media, place(i, media), strict=True):
            load[e] += 1
            cache = caches[e]
            lookups += 1
            if key in cache:
                hits += 1
                cache.move_to_end(key)
            elif capacity:
                cache[key] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    mean = lookups / encoders
    return MMResult(policy, encoders, capacity, len(requests), lookups, hits, hits / lookups if lookups else 0.0,
                    max(load) / mean if mean else 0.0)


def ceiling(requests: Sequence[tuple[str, ...]]) -> float:
    """Hit rate of one unbounded cache shared by every encoder: all lookups but each image's first."""
    lookups = sum(map(len, requests))
    return 1 - len({k for r in requests for k in r}) / lookups if lookups else 0.0


def sweep(requests: Sequence[tuple[str, ...]], encoders: int, capacities: Sequence[int],
          policies: Sequence[str] = POLICIES) -> list[dict]:
    """One record per capacity: each policy's hit rate and load imbalance, and consistent
    hashing's hit rate relative to round-robin (``ch_gain``: 0.3 = 30% more hits)."""
    rows = []
    for cap in capacities:
        row: dict = {"capacity": cap, "encoders": encoders}
        for pol in policies:
            r = simulate(requests, encoders, cap, make_placement(pol, encoders), pol)
            row[f"{pol}_hit"] = r.hit_rate
            row[f"{pol}_imbalance"] = r.load_imbalance
        rr, ch = row.get("round_robin_hit"), row.get("consistent_hash_hit")
        if rr is not None and ch is not None:
            row["ch_gain"] = ch / rr - 1 if rr else float("inf") if ch else 0.0
        rows.append(row)
    return rows


def table(rows: Sequence[dict], catalog: int) -> str:
    pols = [p for p in POLICIES if f"{p}_hit" in rows[0]] if rows else []
    head = ["capacity", "of catalog"] + [f"{p} hit" for p in pols] + ["CH vs RR"] + [f"{p} imbal." for p in pols]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        gain = r.get("ch_gain")
        cells = [str(r["capacity"]), f"{100 * r['capacity'] / catalog:.2f}%"]
        cells += [f"{100 * r[f'{p}_hit']:.1f}%" for p in pols]
        cells += [f"{100 * gain:+.0f}%" if gain is not None else "-"]
        cells += [f"{r[f'{p}_imbalance']:.2f}" for p in pols]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows: Sequence[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    caps = [r["capacity"] for r in rows]
    for pol in POLICIES:
        if f"{pol}_hit" in rows[0]:
            ax.plot(caps, [100 * r[f"{pol}_hit"] for r in rows], marker="o", label=pol)
    ax.set_xscale("log")
    ax.set_xlabel("embeddings cached per encoder")
    ax.set_ylabel("encoder cache hit rate (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoders", type=int, default=8, help="encoder servers (default %(default)s)")
    p.add_argument("--images", type=int, default=MMTraceConfig.images, help="catalog size (default %(default)s)")
    p.add_argument("--requests", type=int, default=MMTraceConfig.requests, help="requests (default %(default)s)")
    p.add_argument("--zipf", type=float, default=MMTraceConfig.zipf_s, help="Zipf exponent s (default %(default)s)")
    p.add_argument("--capacities", default="0.0025,0.005,0.01,0.02,0.05,0.1,0.2,0.5",
                   help="per-encoder cache sizes as fractions of the catalog (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="trace seed (default %(default)s)")
    p.add_argument("--json", dest="json_path", help="write the sweep here")
    p.add_argument("--plot", dest="plot_path", help="write a PNG of hit rate against capacity")


def run(a: argparse.Namespace) -> int:
    try:
        cfg = MMTraceConfig(requests=a.requests, images=a.images, zipf_s=a.zipf, seed=a.seed)
        caps = sorted({max(1, round(float(x) * cfg.images)) for x in a.capacities.split(",") if x})
        if a.encoders < 1 or not caps:
            raise ValueError("--encoders must be >= 1 and --capacities non-empty")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reqs = generate(cfg)
    distinct = len({k for r in reqs for k in r})
    top = ceiling(reqs)
    print(f"{len(reqs)} requests, {sum(map(len, reqs))} images ({distinct} distinct of {cfg.images}), "
          f"Zipf s={cfg.zipf_s}, {a.encoders} encoders; ceiling (one shared unbounded cache) {100 * top:.1f}%")
    rows = sweep(reqs, a.encoders, caps)
    print(table(rows, cfg.images))
    if a.json_path:
        Path(a.json_path).write_text(json.dumps({"trace": asdict(cfg), "encoders": a.encoders, "ceiling": top,
                                                 "rows": rows}, indent=1) + "\n")
        print(f"wrote {a.json_path}")
    if a.plot_path:
        plot(rows, a.plot_path, f"{a.encoders} encoders, {cfg.images} images, Zipf s={cfg.zipf_s}, "
                                f"{cfg.requests} requests")
        print(f"wrote {a.plot_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gcache-router mmsim", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
