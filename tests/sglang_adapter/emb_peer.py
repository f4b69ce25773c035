"""A second encoder process for test_embedding_store: a real EmbeddingCacheController over a
gcache store inserts embeddings, then prints the store's metrics as one JSON line.

    python -m tests.sglang_adapter.emb_peer NODES COUNT TOKENS HIDDEN
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    nodes, count, tokens, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from gcache.bench import torchvision_stub

    torchvision_stub.install()
    from sglang.srt.managers.schedule_batch import Modality

    from sglang_adapter.embedding import GCacheEmbeddingStore
    from tests.sglang_adapter import emb_shim as S

    store = GCacheEmbeddingStore({"nodes": nodes, "model": "test/vlm"})
    ctrl = S.controller(store, hidden=hidden, pool_mib=8)
    hashes = [f"peer-{i}" for i in range(count)]
    staged = S.stage(ctrl, hashes, [S.embedding(1000 + i, tokens, hidden) for i in range(count)])
    ctrl.insert_batch(staged, Modality.IMAGE)
    ctrl.insert_queue.join()  # the controller's IO thread has run the batch PUT
    S.stop(ctrl)
    print(json.dumps({"staged": staged, **store.metrics()}), flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
