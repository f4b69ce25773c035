"""Launch SGLang with gcache as its multimodal global embedding store.

    python -m sglang_adapter.launch --model-path Qwen/Qwen2.5-VL-7B-Instruct --encoder-only \\
        --enable-mm-global-cache --mm-global-cache-backend gcache \\
        --gcache-emb-config '{"nodes": "127.0.0.1:7400", "model": "qwen2.5-vl-7b"}'

Everything but ``--gcache-emb-config`` goes to ``sglang.launch_server`` unchanged. SGLang 0.5.23
knows only the "mooncake" embedding store: its factory has a registry but no dynamic loader,
and the command line allows only "mooncake". Importing this module (``install()``) registers
"gcache" with the factory and adds it to the command line's choices, in this process only; the
installed sglang is not edited. SGLang starts its other processes (encoder TP ranks > 0, DP
workers) with multiprocessing's "spawn", which imports the main module again in each child, so
running SGLang through this module registers the backend there too.

``--gcache-emb-config`` (a JSON object, see sglang_adapter.emb_config) is passed on through
``$GCACHE_EMB_CONFIG``, which the spawned processes inherit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from sglang_adapter.emb_config import ENV_CONFIG, EmbeddingStoreConfig

log = logging.getLogger(__name__)
BACKEND = "gcache"
CLI_FLAG = "--mm-global-cache-backend"


def allow_backend(parser: argparse.ArgumentParser) -> bool:
    """Add "gcache" to the choices of SGLang's ``--mm-global-cache-backend``; False when the
    parser has no such option (another sglang version)."""
    for action in parser._actions:
        if CLI_FLAG in action.option_strings:
            if action.choices is not None and BACKEND not in action.choices:
                action.choices = [*action.choices, BACKEND]
            return True
    return False


def install() -> None:
    """Register the gcache embedding store with SGLang's factory and allow it on SGLang's command
    line (idempotent)."""
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
    from sglang.srt.server_args import ServerArgs

    if BACKEND not in EmbeddingStoreFactory._registry:
        EmbeddingStoreFactory.register_backend(BACKEND, "sglang_adapter.embedding", "GCacheEmbeddingStore")
    add = ServerArgs.add_cli_args
    if getattr(add, "_gcache_backend", False):
        return

    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add(parser)
        if not allow_backend(parser):
            log.warning("sglang has no %s option: the gcache embedding store cannot be selected", CLI_FLAG)

    add_cli_args._gcache_backend = True  # type: ignore[attr-defined]
    ServerArgs.add_cli_args = staticmethod(add_cli_args)


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --gcache-emb-config value or None, the arguments for SGLang). Raises ConfigError
    when the value is not a valid store configuration (the model may still come from SGLang)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--gcache-emb-config", default=None)
    ours, rest = p.parse_known_args(argv)
    if ours.gcache_emb_config is not None:
        EmbeddingStoreConfig.load(ours.gcache_emb_config, default_model="(from sglang)")
    return ours.gcache_emb_config, rest


def main(argv: list[str] | None = None) -> int:
    from gcache.errors import ConfigError

    try:
        emb_config, rest = split_args(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"sglang_adapter.launch: --gcache-emb-config: {exc}", file=sys.stderr)
        return 2
    if emb_config is not None:
        os.environ[ENV_CONFIG] = emb_config
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(rest)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


install()  # at import: in the launcher and in every process SGLang spawns from it

if __name__ == "__main__":
    sys.exit(main())
