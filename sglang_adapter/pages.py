"""Host-pool pages as byte views (zero-copy) and the per-call bookkeeping of the adapter.

A registered SGLang host pool describes where a page lives with ``get_page_buffer_meta``:
pointers and sizes, one or more buffers per page (page_first / page_first_direct: K and V;
layer_first: K and V of every layer; MLA: one). Each page becomes one gcache value made of
those buffers, sent and received scatter-gather straight from / into the pool's memory.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from typing import Any

#: host-pool attributes holding the pool's pages as one CPU tensor (MHA and MLA pools: ``kv_buffer``;
#: pools with K and V apart: ``k_buffer`` / ``v_buffer``)
_PAGE_TENSORS = ("kv_buffer", "k_buffer", "v_buffer")


def _view(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


def _spans(host_pool: Any) -> list[tuple[int, int, memoryview]]:
    """(start, end, byte view) of each contiguous CPU page tensor of ``host_pool``, made per call
    (a pool that reallocates its tensors is never read through a stale view)."""
    import torch

    out = []
    for name in _PAGE_TENSORS:
        t = getattr(host_pool, name, None)
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel():
            start, n = int(t.data_ptr()), t.numel() * t.element_size()
            out.append((start, start + n, _view(start, n)))
    return out


def page_views(host_pool: Any, host_indices: Any, n_pages: int) -> list[list[memoryview]]:
    """For each of ``n_pages`` pages at ``host_indices`` (page_size indices per page), the list of
    memoryviews over its buffers in the host pool. Raises ValueError if the pool's metadata does
    not split evenly into pages. A buffer inside one of the pool's page tensors is a slice of one
    view of that tensor (one view per tensor, not per buffer); any other gets its own view."""
    if n_pages == 0:
        return []
    ptrs, sizes = host_pool.get_page_buffer_meta(host_indices)
    if len(ptrs) != len(sizes) or len(ptrs) % n_pages:
        raise ValueError(f"{type(host_pool).__name__}: {len(ptrs)} buffers for {n_pages} pages")
    spans = _spans(host_pool)
    views: list[memoryview] = []
    for p, s in zip(ptrs, sizes):
        p, s = int(p), int(s)
        for start, end, whole in spans:
            if start <= p and p + s <= end:
                views.append(whole[p - start:p - start + s])
                break
        else:
            views.append(_view(p, s))
    per = len(ptrs) // n_pages
    return [views[i * per:(i + 1) * per] for i in range(n_pages)]


def page_bytes(host_pool: Any) -> int:
    """Bytes one page of ``host_pool`` takes in gcache (all its buffers)."""
    import torch

    idx = torch.arange(0, host_pool.page_size, dtype=torch.int64)
    _, sizes = host_pool.get_page_buffer_meta(idx)
    return int(sum(sizes))


#: SGLang server arguments that decide what the model computes from its input: the checkpoint
#: loaded (model path, revision, a decrypted config), how its weights are loaded ("dummy" gives
#: random weights, "gguf" / "bitsandbytes" quantized ones), their dtype and quantization
#: (ModelOpt's too, or a restored ModelOpt checkpoint), config overrides (rope scaling...), the
#: weights' version label, and the multimodal preprocessing (image sizes). They change the KV
#: pages and a multimodal encoder's embeddings alike (model_identity; the embedding store's keys).
MODEL_ARGS = ("model_path", "revision", "decrypted_config_file", "load_format", "dtype", "quantization",
              "modelopt_quant", "modelopt_checkpoint_restore_path", "quantize_and_serve", "rl_quant_profile",
              "json_model_override_args", "weight_version", "mm_process_config",
              "enable_precise_embedding_interpolation")

#: SGLang server arguments that change only what a KV page's bytes mean without changing the host
#: pool: the logical KV cache dtype (the pool holds fp8_e4m3 and fp8_e5m2 alike as uint8) and its
#: scales, a Mamba pool's SSM state dtype, an indexer cache's dtype, the CPU experts' weights and
#: their quantization (KTransformers), MoE activation precision, sparse attention, and with
#: speculative decoding the draft model (the host pool packs its layers into every page: its
#: algorithm, checkpoint, revision, load format, config, quantization and KV cache dtype decide
#: those bytes).
KV_ARGS = ("kv_cache_dtype", "quantization_param_path", "mamba_ssm_dtype", "enable_int8_mamba_checkpoint",
           "qsa_indexer_dtype", "enable_deepseek_v4_fp4_indexer",
           "kt_weight_path", "kt_method", "kt_num_gpu_experts",
           "enable_w4a4_mxfp4_megamoe", "flashinfer_mxfp4_moe_precision", "enable_hisparse", "hisparse_config",
           "speculative_algorithm", "speculative_draft_model_path", "speculative_draft_model_revision",
           "speculative_draft_load_format", "decrypted_draft_config_file", "speculative_draft_model_quantization",
           "speculative_draft_kv_cache_dtype", "speculative_enable_w4a4_mxfp4_megamoe")

#: Everything that decides a KV page's bytes beyond what the host pool shows (deployment_identity).
#: Not here, on purpose: what only decides how the same values are computed or scheduled
#: (attention / MoE / sampling backends, parallelism, memory and cache sizes, CUDA graphs,
#: model_impl, the image processor implementation), where a difference would only split caches.
IDENTITY_ARGS = MODEL_ARGS + KV_ARGS

#: arguments that count only when the one named is set (their defaults say nothing otherwise:
#: kt_method defaults to "AMXINT4" whether or not KTransformers is used)
_ONLY_WITH = {"kt_method": "kt_weight_path", "kt_num_gpu_experts": "kt_weight_path",
              "hisparse_config": "enable_hisparse"}

#: values that mean "not set": the automatic or default choice
_UNSET = ("", "auto", "default", "{}", False)


def _unset(value: Any) -> bool:
    """Whether ``value`` is an argument's "not set" (None or _UNSET; 0 is a value: 0 GPU experts)."""
    return value is None or any(type(value) is type(u) and value == u for u in _UNSET) or value == {}


def _server_args() -> Any:
    """The SGLang process's server arguments (sglang.srt.runtime_context); None outside a
    scheduler, or with an older sglang."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # noqa: BLE001 - not published (not in a scheduler), or an older sglang
        return None


def served_model(server_args: Any = None) -> str:
    """The served model's name (``served_model_name``, else ``model_path``) from ``server_args``
    or else the process's; "" when neither says."""
    args = server_args if server_args is not None else _server_args()
    return str(getattr(args, "served_model_name", None) or getattr(args, "model_path", None) or "")


def _identity(names: Sequence[str], server_args: Any) -> list[str]:
    """``name=value`` of each argument of ``names`` set to something other than its automatic
    default, from ``server_args`` or else the process's (sglang.srt.runtime_context; none
    outside an SGLang process)."""
    if server_args is None:
        server_args = _server_args()
        if server_args is None:
            return []
    out = []
    for name in names:
        value = getattr(server_args, name, None)
        if _unset(value) or (name in _ONLY_WITH and _unset(getattr(server_args, _ONLY_WITH[name], None))):
            continue
        if isinstance(value, (dict, list, tuple)):  # the same settings in another order are the same
            value = json.dumps(value, sort_keys=True, default=str)
        out.append(f"{name}={value}")
    return out


def model_identity(server_args: Any = None) -> list[str]:
    """What the server arguments say about the model's output (MODEL_ARGS): the part of the
    deployment identity an encoder's embeddings depend on."""
    return _identity(MODEL_ARGS, server_args)


def deployment_identity(server_args: Any = None) -> list[str]:
    """What the server arguments say about a KV page's bytes (IDENTITY_ARGS)."""
    return _identity(IDENTITY_ARGS, server_args)


def pool_format(host_pool: Any, identity: Sequence[str] = ()) -> str:
    """The byte format of ``host_pool``'s pages (keys.page_format): class, layout, dtype, page
    size, the size of every buffer one page is made of, its layer range (pipeline stages with
    the same number of other layers), a Mamba pool's SSM state dtype, and ``identity``
    (deployment_identity)."""
    import torch

    from sglang_adapter.keys import page_format

    page_size = int(getattr(host_pool, "page_size", 1) or 1)
    _, sizes = host_pool.get_page_buffer_meta(torch.arange(0, page_size, dtype=torch.int64))
    extra = [f"layers={getattr(host_pool, 'start_layer', '')}-{getattr(host_pool, 'end_layer', '')}"]
    temporal = getattr(host_pool, "temporal_dtype", None)
    if temporal is not None:
        extra.append(f"ssm={temporal}")
    return page_format(type(host_pool).__name__, str(getattr(host_pool, "layout", "")),
                       str(getattr(host_pool, "dtype", "")), page_size, [int(s) for s in sizes],
                       [*extra, *identity])
