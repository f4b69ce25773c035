"""SGLang HiCache L3 backend backed by gcache (SWA-aware). See docs/sglang.md.

The backend class is ``sglang_adapter.backend.GCacheStorage`` (it imports sglang); the pure
parts (config, keys, window-safe matching) import without it.
"""
