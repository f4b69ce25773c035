"""Test-only scaffolding to run SGLang 0.5.23's real EmbeddingCacheController on a CPU-only host.

Two things in the controller need a GPU, and only those are replaced here:

* its constructor allocates the host pools with ``pin_memory=True`` (CPU torch refuses) and
  reads the parallel state from ``get_parallel()``: ``controller()`` builds it with unpinned pools
  under a single-rank parallel state (sglang's own ``get_parallel().override``);
* ``store_to_pool_async`` / ``wait_store_to_pool`` copy a freshly encoded CUDA tensor into the
  pool on a side stream: ``stage()`` does the same on CPU, through the controller's own page
  allocator (with eviction), copy plan and READY transition.

Everything else (insert_batch, prefetch, the IO thread, batch_is_exist, eviction, get_pool_views)
is the installed controller's code, talking to the real store.
"""

from __future__ import annotations

import types
from unittest import mock

import torch


def _imports():
    from gcache.bench import torchvision_stub

    torchvision_stub.install()  # sglang's config modules import torchvision; the PyPI build needs CUDA
    from sglang.srt.managers.schedule_batch import Modality
    from sglang.srt.mem_cache import embedding_cache_controller as ecc

    return ecc, Modality


def controller(store, hidden=64, dtype=torch.bfloat16, pool_mib=1.0, audio_hidden=None):
    """A real EmbeddingCacheController over ``store``: vision pool of ``hidden`` (80% of
    ``pool_mib``), audio pool of ``audio_hidden`` (default the same)."""
    ecc, modality = _imports()
    from sglang.srt.runtime_context import get_parallel

    real = ecc.EmbeddingCacheController._create_pools
    dims = {modality.IMAGE: hidden}
    if audio_hidden is not None:
        dims[modality.AUDIO] = audio_hidden
    with mock.patch.object(ecc.EmbeddingCacheController, "_create_pools",
                           lambda self, pin_memory: real(self, pin_memory=False)), \
            get_parallel().override(tp_size=1, tp_rank=0, tp_group=types.SimpleNamespace(cpu_group=None)):
        return ecc.EmbeddingCacheController(store, max_pool_size_gb=pool_mib / 1024, hidden_dims=dims,
                                            dtype=dtype)


def stop(ctrl) -> None:
    ctrl.stop_event.set()
    ctrl.io_thread.join(timeout=10)


def stage(ctrl, hashes, tensors, modality=None) -> list[str]:
    """CPU stand-in for store_to_pool_async + wait_store_to_pool: the embeddings that got pages
    become READY entries of the controller's pool. Returns the hashes staged."""
    ecc, mod = _imports()
    modality = modality or mod.IMAGE
    pool = ctrl._get_pool(modality)
    pending = []
    with ctrl.lock:
        for h, t in zip(hashes, tensors):
            t = t.reshape(-1, t.shape[-1])
            if t.shape[1] != pool.dim or h in ctrl.entries:
                continue
            runs = ctrl._allocate_with_eviction(pool, t.shape[0])
            if runs is None:
                continue
            entry = ecc.EmbeddingCacheEntry(hash=h, modality=modality, num_tokens=t.shape[0], dim=t.shape[1],
                                            page_runs=runs, state=ecc.EntryState.FILLING)
            ctrl.entries[h] = entry
            pending.append((t, entry))
    handles = []
    for t, entry in pending:
        ctrl._copy_embedding_page_runs(src=t.to(pool.dtype), dst=pool.tensor, entry=entry, pool=pool,
                                       src_is_pool=False)
        handles.append((entry, ecc.AsyncCopyHandle(event=None, entry_hash=entry.hash)))
    ctrl.wait_store_to_pool(handles)
    return [e.hash for _, e in pending]


def pool_bytes(ctrl, mm_hash) -> torch.Tensor | None:
    """The READY embedding ``mm_hash`` read back from the controller's pool (None if absent)."""
    views = ctrl.get_pool_views([mm_hash])[0]
    if views is None:
        return None
    try:
        return torch.cat(views).clone()
    finally:
        ctrl.release_pool_views([mm_hash])


def embedding(seed, tokens, hidden, dtype=torch.bfloat16) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=g).to(dtype)
