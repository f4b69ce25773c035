"""The offline optimum (Belady with prefix semantics) and the policy simulation, on traces small
enough to check by hand."""

import pytest

from gcache.bench.optimum import NEVER, belady, lru_oracle_admission, next_uses
from gcache.bench.policysim import SimConfig, global_lru, simulate
from gcache.bench.trace import TraceRequest, scan_trace, trace_max
from gcache.tier.eviction import EvictionConfig, EvictionKind

B = 512


def req(t, *ids):
    return TraceRequest(t, len(ids) * B, 0, tuple(ids))


# 1,2 | 1,3 | 1,2: the stream is 1 2 1 3 1 2
ABA = [req(0, 1, 2), req(1, 1, 3), req(2, 1, 2)]


def test_next_uses():
    assert next_uses(ABA) == [2, 5, 4, NEVER, NEVER, NEVER]


def test_belady_keeps_what_comes_back_and_lru_does_not():
    # Belady, 2 slots: r0 caches 1, 2. r1 hits 1; 3 is never used again, so it is the one
    # evicted (not 2). r2 hits 1 and 2. LRU evicts 2 for 3, so r2 hits only 1.
    assert belady(ABA, 2).hit_tokens == 3 * B
    assert global_lru(ABA, 2).hit_tokens == 2 * B
    assert belady(ABA, 1).hit_tokens == 2 * B  # 1 slot: block 1 stays for every later request
    assert belady(ABA, 0).hit_tokens == 0


def test_lru_with_perfect_admission():
    # 1 slot: r0 writes 1 then 2 (both come back), LRU keeps 2; r1 misses, writes 1 again (it comes
    # back) but not 3 (it never does); r2 hits 1. 2 slots: r0 keeps 1 and 2, r1 hits 1 and does
    # not write 3, r2 hits 1 and 2.
    assert lru_oracle_admission(ABA, 1).hit_tokens == 1 * B
    assert lru_oracle_admission(ABA, 2).hit_tokens == 3 * B == belady(ABA, 2).hit_tokens


def test_belady_counts_only_the_leading_run():
    trace = [req(0, 1, 2), req(1, 5, 2)]  # 2 is cached, but after a miss it is useless
    assert belady(trace, 10).hit_tokens == 0


def test_belady_with_room_for_everything_is_the_trace_maximum():
    trace = [req(0, 1, 2, 3), req(1, 1, 2), req(2, 1, 4), req(3, 1, 2, 3, 5), req(4, 1, 4, 6)]
    best = trace_max(trace)
    assert belady(trace, 6).hit_tokens == best.hit_tokens == (2 + 1 + 3 + 2) * B
    assert belady(trace, 3).hit_tokens <= best.hit_tokens
    assert all(belady(trace, c).hit_tokens >= global_lru(trace, c).hit_tokens for c in range(7))


def test_simulated_lru_matches_a_hand_run():
    # 2 slots, one node. r0: put 1,2. r1: 1 hits, 3 misses -> put 3 evicts 2 (least recent). r2: 1
    # hits, 2 misses.
    acc = simulate(ABA, SimConfig(2, eviction=EvictionConfig(EvictionKind.LRU)))
    assert acc.hit_tokens == 2 * B and acc.requests == 3


def test_nvme_tier_holds_what_ram_drops():
    ram_only = simulate(ABA, SimConfig(1, eviction=EvictionConfig(EvictionKind.LRU)))
    tiered = simulate(ABA, SimConfig(1, 4, eviction=EvictionConfig(EvictionKind.LRU)))
    assert tiered.hit_tokens == trace_max(ABA).hit_tokens > ram_only.hit_tokens


@pytest.mark.parametrize("nodes", [1, 3])
def test_hot_set_survives_a_scan_in_simulation(nodes):
    trace = scan_trace(capacity_blocks=60)
    best = trace_max(trace).hit_tokens
    rate = {k: simulate(trace, SimConfig(60, nodes=nodes, eviction=EvictionConfig(k))).hit_tokens / best
            for k in EvictionKind}
    assert rate[EvictionKind.LRU] < 0.3  # only the warm-up repeats hit
    assert rate[EvictionKind.REUSE] > 0.95
    assert rate[EvictionKind.S3FIFO] > 0.95


def test_simulated_nvme_log_reclaims_whole_segments_and_stale_records_hold_space():
    from gcache.bench.policysim import SimDisk

    d = SimDisk(slots=4, segment_slots=2)
    for b in (1, 2, 3):
        d.append(b)
    d.forget(1)  # overwritten: unreachable, but its record still takes a slot
    d.append(4)  # 4 slots used: fits
    assert [b in d for b in (1, 2, 3, 4)] == [False, True, True, True]
    d.append(5)  # over budget: the oldest segment (1, 2) goes whole, 2 with it
    assert [b in d for b in (2, 3, 4, 5)] == [False, True, True, True] and d.used == 3
