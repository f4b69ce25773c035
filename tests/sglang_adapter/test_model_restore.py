"""Model check: a tiny deterministic hybrid (full + sliding-window) attention model in torch.

Prefill N tokens, store the KV through the adapter (every page of the full-attention layers,
only the trailing window of the SWA layers), restore into fresh host pools and a fresh KV
state, decode: logits equal recomputing from scratch. With one SWA page missing inside the
window, the window-safe check refuses that length, and using the state anyway changes logits.
"""

from __future__ import annotations

import pytest

from tests.sglang_adapter.conftest import make_storage, mha_host_pool

pytestmark = pytest.mark.usefixtures("sgl")
P, W, H, DH, D, VOCAB = 4, 8, 2, 8, 16, 50  # page, window (tokens), heads, head dim, model dim
KINDS = ["full", "swa", "swa", "full", "swa"]
N = 6 * P


class TinyHybrid:
    def __init__(self, seed=0):
        import torch

        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g) * 0.3
        self.emb, self.pos, self.out = r(VOCAB, D), r(64, D), r(D, VOCAB)
        self.layers = [{"q": r(D, H * DH), "k": r(D, H * DH), "v": r(D, H * DH), "o": r(H * DH, D)} for _ in KINDS]

    def forward(self, tokens, start, kv):
        """Run ``tokens`` at positions start.. given ``kv`` (per layer (K, V) [T, H, DH] for
        positions < start, appended in place); returns the last position's logits."""
        import torch

        x = self.emb[torch.tensor(tokens)] + self.pos[start:start + len(tokens)]
        n = len(tokens)
        for kind, w, cache in zip(KINDS, self.layers, kv):
            q = (x @ w["q"]).view(n, H, DH)
            cache[0] = torch.cat([cache[0], (x @ w["k"]).view(n, H, DH)])
            cache[1] = torch.cat([cache[1], (x @ w["v"]).view(n, H, DH)])
            t = cache[0].shape[0]
            qpos = torch.arange(start, start + n)[:, None]
            kpos = torch.arange(t)[None, :]
            mask = kpos <= qpos
            if kind == "swa":
                mask &= kpos > qpos - W
            att = torch.einsum("qhd,khd->hqk", q, cache[0]) / DH ** 0.5
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + torch.einsum("hqk,khd->qhd", att, cache[1]).reshape(n, H * DH) @ w["o"]
        return x[-1] @ self.out


def _empty_kv():
    import torch

    return [[torch.zeros(0, H, DH), torch.zeros(0, H, DH)] for _ in KINDS]


def _layers(kind):
    return [i for i, k in enumerate(KINDS) if k == kind]


def _to_pool(pool, kv, layer_ids, positions):
    for j, li in enumerate(layer_ids):
        pool.kv_buffer[0, positions, j] = kv[li][0][positions]
        pool.kv_buffer[1, positions, j] = kv[li][1][positions]


def _run(cluster_nodes, drop_swa_page):
    import torch
    from sglang.srt.mem_cache.hicache_storage import (
        HiCacheStorageExtraInfo,
        PoolHitPolicy,
        PoolName,
        PoolTransfer,
    )
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    model = TinyHybrid()
    tokens = [int(t) for t in torch.randint(0, VOCAB, (N + 1,), generator=torch.Generator().manual_seed(5))]
    kv = _empty_kv()
    model.forward(tokens[:N], 0, kv)  # prefill
    full, swa = _layers("full"), _layers("swa")
    hashes = get_storage_hash_str(tokens[:N], None, page_size=P)
    win = W // P

    def pools():
        a = mha_host_pool("page_first", layers=len(full), heads=H, head_dim=DH, v_head_dim=DH, page=P, tokens=64)
        b = mha_host_pool("page_first", layers=len(swa), heads=H, head_dim=DH, v_head_dim=DH, page=P, tokens=64)
        return a, b

    def storage(kv_pool, swa_pool):
        s = make_storage(cluster_nodes, extra={"hicache_storage_pass_prefix_keys": True})
        s.register_mem_pool_host(kv_pool)
        s.register_mem_host_pool_v2(kv_pool, PoolName.KV)
        s.register_mem_host_pool_v2(swa_pool, PoolName.SWA)
        return s

    # store: all full-attention pages, the SWA trailing window only
    kv_pool, swa_pool = pools()
    _to_pool(kv_pool, kv, full, torch.arange(N))
    _to_pool(swa_pool, kv, swa, torch.arange(N - W, N))
    w = storage(kv_pool, swa_pool)
    assert w.batch_set_v1(hashes, torch.arange(N)) == [True] * (N // P)
    swa_t = PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(N - W, N), keys=hashes[-win:],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
    assert w.batch_set_v2([swa_t], HiCacheStorageExtraInfo(prefix_keys=hashes[:-win])) == {"swa": [True] * win}
    if drop_swa_page:
        w.client.delete(w.page_keys([hashes[-1]], "swa"))

    # restore into fresh pools and a fresh KV state
    kv_pool2, swa_pool2 = pools()
    r = storage(kv_pool2, swa_pool2)
    probe = PoolTransfer(name=PoolName.SWA, keys=["?"] * win, hit_policy=PoolHitPolicy.TRAILING_PAGES)
    found = r.batch_exists_v2(hashes, [probe])
    pages = N // P
    r.batch_get_v1(hashes, torch.arange(N))
    got = r.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(N - W, N),
                                       keys=hashes[-win:])])
    state = _empty_kv()
    for j, li in enumerate(full):
        state[li] = [kv_pool2.kv_buffer[0, :N, j].clone(), kv_pool2.kv_buffer[1, :N, j].clone()]
    for j, li in enumerate(swa):  # positions before the window are never attended: leave zeros
        state[li] = [swa_pool2.kv_buffer[0, :N, j].clone(), swa_pool2.kv_buffer[1, :N, j].clone()]
        state[li][0][: N - W] = 0
        state[li][1][: N - W] = 0
    restored = model.forward(tokens[N:], N, state)
    scratch = model.forward(tokens, 0, _empty_kv())
    return found, pages, got, restored, scratch


def test_restored_state_decodes_like_recomputing(adapter_cluster):
    import torch

    found, pages, got, restored, scratch = _run(adapter_cluster.addresses, drop_swa_page=False)
    assert found.kv_hit_pages == pages and pages in found.restorable_prefix_pages
    assert got == {"swa": [True, True]}
    torch.testing.assert_close(restored, scratch, rtol=1e-5, atol=1e-5)


def test_window_safe_check_refuses_a_hole_that_would_change_logits(adapter_cluster):
    import torch

    found, pages, got, restored, scratch = _run(adapter_cluster.addresses, drop_swa_page=True)
    assert pages not in found.restorable_prefix_pages  # refused ...
    assert found.kv_hit_pages < pages
    assert got == {"swa": [True, False]}
    assert not torch.allclose(restored, scratch, rtol=1e-3, atol=1e-3)  # ... because using it is wrong
