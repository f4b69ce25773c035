"""Pure core: block hashing, prefix index, config validation, buckets, encoder ring, request parsing."""

from __future__ import annotations

import pytest

from router.buckets import BucketMap
from router.config import BucketConfig, PolicyConfig, PrefixConfig, QueueConfig, RouterConfig, WorkerSpec
from router.cost import PrefillCost
from router.encoder import EncoderRing
from router.prefix import PrefixIndex, chain_text_hashes, chain_token_hashes
from router.request import BadRequest, parse_request


def test_chained_hashes_share_exactly_the_common_prefix():
    a = chain_token_hashes(list(range(40)), 8)
    b = chain_token_hashes(list(range(24)) + [999] + list(range(25, 40)), 8)
    assert len(a) == 5 and a[:3] == b[:3] and a[3] != b[3] and a[4] != b[4]
    assert chain_token_hashes(list(range(7)), 8) == []
    # same block content at a different position hashes differently (chained)
    assert chain_token_hashes([1] * 16, 8)[0] != chain_token_hashes([1] * 16, 8)[1]
    assert chain_text_hashes("ab" * 10, 4) == chain_text_hashes("ab" * 10 + "x", 4)


def test_prefix_index_match_lru_bound_and_ttl():
    idx = PrefixIndex(max_blocks_per_worker=4, ttl_s=10)
    idx.insert("w1", [1, 2, 3], now=0)
    assert idx.match("w1", [1, 2, 3, 4], now=1) == 3
    assert idx.match("w1", [9, 1], now=1) == 0  # a miss ends the match
    assert idx.match("w2", [1], now=1) == 0
    idx.insert("w1", [7, 8], now=2)  # 5 blocks > bound 4: block 1 (oldest) goes
    assert idx.size("w1") == 4
    assert idx.match("w1", [1, 2, 3], now=3) == 0
    assert idx.match("w1", [7, 8], now=11) == 2
    assert idx.match("w1", [7, 8], now=12.5) == 0  # expired


@pytest.mark.parametrize(
    "make",
    [
        lambda: PolicyConfig(affinity_weight=-1),
        lambda: PolicyConfig(busy_scale_ms=0),
        lambda: PrefillCost(a_ms=-1),
        lambda: WorkerSpec("http://x", speed=0),
        lambda: PolicyConfig(cache_threshold=2),
        lambda: QueueConfig(max_wait_s=0),
        lambda: PrefixConfig(block_tokens=0),
        lambda: BucketConfig(((0, 10), (20, 30))),
        lambda: WorkerSpec("localhost:8000"),
        lambda: WorkerSpec("http://x", role="gpu"),
        lambda: RouterConfig(namespace="a:b"),
        lambda: BucketConfig.parse("0-64Q"),
    ],
)
def test_config_rejects_bad_values_with_value_error(make):
    with pytest.raises(ValueError, match=r"\w"):
        make()


def test_bucket_parse_and_grouping():
    cfg = BucketConfig.parse("0-64K,64K-256K,256K-1M")
    assert cfg.ranges == ((0, 65536), (65536, 262144), (262144, 1048576))
    bm = BucketMap(cfg)
    assert [bm.bucket_of(n) for n in (0, 65535, 65536, 300_000, 5_000_000)] == [0, 0, 1, 2, 2]
    ws = [WorkerSpec("http://s1", bucket=0), WorkerSpec("http://s2", bucket=0), WorkerSpec("http://l1", bucket=1)]
    assert bm.group(1000, ws) == (0, ["http://s1", "http://s2"])
    assert bm.group(100_000, ws) == (1, ["http://l1"])
    assert bm.group(500_000, ws) == (1, ["http://l1"])  # no 256K+ worker: next smaller bucket
    ws2 = [WorkerSpec("http://l1", bucket=1), WorkerSpec("http://any")]
    assert bm.group(10, ws2) == (0, ["http://any"])
    assert bm.group(10, []) == (0, [])


def test_hash_ring_is_stable_and_moves_few_keys():
    ring = EncoderRing(["http://e1", "http://e2", "http://e3"])
    keys = [f"img{i}" for i in range(2000)]
    before = {k: ring.owner(k) for k in keys}
    assert before == {k: EncoderRing(["http://e3", "http://e1", "http://e2"]).owner(k) for k in keys}
    assert len(set(before.values())) == 3
    after = EncoderRing(["http://e1", "http://e2", "http://e3", "http://e4"])
    moved = sum(before[k] != after.owner(k) for k in keys)
    assert 0 < moved < 0.4 * len(keys)
    with pytest.raises(LookupError):
        EncoderRing([]).owner("x")


def test_parse_request_variants():
    cfg = PrefixConfig(block_tokens=4, chars_per_token=2)
    p = parse_request("/v1/completions", {"prompt": list(range(10)), "stream": True}, cfg)
    assert (p.n_tokens, p.n_blocks, p.stream) == (10, 2, True)
    p = parse_request("/generate", {"text": "x" * 20, "image_data": ["AAAA"]}, cfg)
    assert (p.n_tokens, p.n_blocks, len(p.media_keys)) == (10, 2, 1)
    chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]}]}
    p1 = parse_request("/v1/chat/completions", chat, cfg)
    p2 = parse_request("/v1/chat/completions", chat, cfg)
    assert p1.media_keys == p2.media_keys and len(p1.media_keys) == 1
    for path, body in [("/v1/completions", {"prompt": 5}), ("/v1/chat/completions", {"messages": []}),
                       ("/v1/chat/completions", {"messages": ["hi"]}), ("/generate", [1, 2])]:
        with pytest.raises(BadRequest):
            parse_request(path, body, cfg)


def test_a_batch_is_routed_by_its_longest_prompt_without_hashing_the_others():
    """A 30 MB batch of 400,000 prompts was hashed whole to find the longest (2.5 s of the event
    loop, every other client waiting); now the longest is picked by length first."""
    import time

    from router.config import PrefixConfig

    cfg = PrefixConfig()
    long = "x" * 4000
    batch = ["a" * 75] * 400_000 + [long] + [[1, 2, 3]] * 1000
    t0 = time.process_time()
    got = parse_request("/v1/completions", {"prompt": batch}, cfg)
    spent = time.process_time() - t0
    assert got.n_tokens == parse_request("/v1/completions", {"prompt": long}, cfg).n_tokens
    assert spent < 0.25, f"{spent:.2f} s of CPU for one batch"
