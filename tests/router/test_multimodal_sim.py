"""The multimodal encoder-cache simulator: the Zipf trace generator, exact LRU accounting on a
hand-made trace, the placement policies, and the ``mmsim`` command."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from router.cli import main
from router.encoder import EncoderRing
from router.sim.multimodal import (
    MMTraceConfig,
    ceiling,
    ch_bounded,
    consistent_hash,
    generate,
    make_placement,
    media_key,
    round_robin,
    simulate,
    sweep,
)


def test_generator_is_deterministic_and_zipf_skewed():
    cfg = MMTraceConfig(requests=4000, images=500, zipf_s=1.0, seed=3)
    a, b = generate(cfg), generate(cfg)
    assert a == b and a != generate(MMTraceConfig(requests=4000, images=500, zipf_s=1.0, seed=4))
    assert len(a) == 4000 and all(1 <= len(r) <= 4 and len(set(r)) == len(r) for r in a)
    counts = Counter(k for r in a for k in r)
    # rank 1 is drawn about twice as often as rank 2 and ten times as often as rank 10 (s = 1)
    assert counts[media_key(0)] > 1.5 * counts[media_key(1)] > 0
    assert counts[media_key(0)] > 5 * counts[media_key(9)]
    flat = generate(MMTraceConfig(requests=4000, images=500, zipf_s=0.0, seed=3))
    assert max(Counter(k for r in flat for k in r).values()) < counts[media_key(0)] / 3


def test_bad_trace_config_is_refused():
    for bad in ({"requests": 0}, {"zipf_s": -1.0}, {"per_request": (0.5, 0.4)}):
        with pytest.raises(ValueError):
            MMTraceConfig(**bad)
    with pytest.raises(ValueError, match="unknown policy"):
        make_placement("random", 2)


def test_lru_accounting_is_exact():
    reqs = [("a",), ("b",), ("a",), ("c",), ("a", "b"), ("b",)]
    everyone_on_0 = lambda i, media: [0] * len(media)
    # capacity 2, one LRU: a b | a(hit) c(evicts b) | a(hit) b(miss, evicts c) | b(hit)
    r = simulate(reqs, 2, 2, everyone_on_0)
    assert (r.images, r.hits, r.load_imbalance) == (7, 3, 2.0)
    assert simulate(reqs, 1, 0, everyone_on_0).hits == 0  # no cache, no hits
    assert simulate(reqs, 1, 10, everyone_on_0).hits == 7 - 3  # unbounded: all but first sightings
    assert ceiling(reqs) == pytest.approx(4 / 7)
    # round-robin on 2 encoders: even requests on 0 (a, a, a b), odd on 1 (b, c, b)
    r = simulate(reqs, 2, 2, round_robin(2))
    assert r.hits == 2 + 1


def test_placements_follow_the_routers_ring():
    reqs = generate(MMTraceConfig(requests=300, images=100, seed=1))
    ring = EncoderRing([f"encoder{e}" for e in range(4)])
    ch = consistent_hash(4)
    for i, media in enumerate(reqs):
        assert ch(i, media) == [int(ring.owner(media[0])[len("encoder"):])] * len(media)
    per_image = make_placement("ch_per_image", 4)
    assert all(per_image(i, m) == [int(ring.owner(k)[len("encoder"):]) for k in m] for i, m in enumerate(reqs))
    # bounded: an owner past its share of the window is passed over for the least loaded
    hot = ("same-image",)
    place = ch_bounded(4, eps=0.5, window=8)
    got = [place(i, hot)[0] for i in range(16)]
    assert len(set(got)) > 1 and Counter(got).most_common(1)[0][1] < 16


def test_consistent_hashing_beats_round_robin_where_caches_are_small():
    reqs = generate(MMTraceConfig(requests=6000, images=3000, zipf_s=0.8, seed=0))
    rows = sweep(reqs, 8, [15, 60, 3000])
    for row in rows:
        assert row["consistent_hash_hit"] > row["round_robin_hit"]
        assert row["ch_per_image_hit"] >= row["consistent_hash_hit"] - 1e-9
        assert row["ch_per_image_hit"] <= ceiling(reqs) + 1e-9
    assert rows[0]["ch_gain"] >= 0.3 and rows[1]["ch_gain"] >= 0.3


def test_mmsim_command_writes_the_curve(tmp_path, capsys):
    out = tmp_path / "mm.json"
    assert main(["mmsim", "--requests", "800", "--images", "400", "--encoders", "4",
                 "--capacities", "0.01,0.1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["capacity"] for r in doc["rows"]] == [4, 40] and 0 < doc["ceiling"] < 1
    assert "CH vs RR" in capsys.readouterr().out
    assert main(["mmsim", "--encoders", "0"]) == 2
