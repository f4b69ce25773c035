"""Opt-in, for benchmarks and tests on a CPU-only host: let sglang's modules import without
torchvision.

sglang 0.5.23 imports ``torchvision.transforms`` at module level in two modules that the HiCache
and embedding-cache code pull in (``sglang.srt.configs.deepseek_ocr`` and
``sglang.srt.multimodal.internvl_utils``), although only multimodal preprocessing calls it.
PyPI's torchvision is CUDA-linked and fails to import beside the CPU torch, and the test venv
does not install it. :func:`install` wraps ``builtins.__import__`` so that an ``import
torchvision...`` issued *by a module of the sglang package* yields an inert stub; any other
importer still gets ``ModuleNotFoundError``. Nothing is put in ``sys.modules`` and no finder is
registered, so ``importlib.util.find_spec("torchvision")`` still reports it absent and the
feature checks of sglang and transformers take their no-torchvision branches (a ``sys.modules``
entry would make them believe it is installed).

Never imported by gcache, the router or the SGLang adapter: only by the benchmarks that run
sglang's classes (``gcache bench embedding``, ``gcache bench swa-capacity``) and by
tests/sglang_adapter, each calling :func:`install` before its first sglang import.
"""

from __future__ import annotations

import builtins
import types
from collections.abc import Mapping
from typing import Any

STUBBED = "torchvision"
IMPORTERS = "sglang"  # only modules of this package (and its subpackages) get the stub
_installed = False


class _Stub(types.ModuleType):
    """A module whose every attribute is another stub; calling one returns a stub."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _Stub(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Stub(f"{self.__name__}()")


_ROOT = _Stub(STUBBED)


def _wants_stub(name: str, importer: Mapping[str, Any] | None, level: int) -> bool:
    if level != 0 or not (name == STUBBED or name.startswith(STUBBED + ".")):
        return False
    mod = importer.get("__name__", "") if importer else ""
    return isinstance(mod, str) and (mod == IMPORTERS or mod.startswith(IMPORTERS + "."))


def install() -> None:
    """Idempotent. Only ``import torchvision[...]`` statements inside sglang's modules change."""
    global _installed
    if _installed:
        return
    real_import = builtins.__import__

    def hooked(name: str, globals: Mapping[str, Any] | None = None, locals: Mapping[str, Any] | None = None,
               fromlist: Any = (), level: int = 0) -> Any:
        if _wants_stub(name, globals, level):
            if not fromlist:
                return _ROOT
            mod: Any = _ROOT
            for part in name.split(".")[1:]:
                mod = getattr(mod, part)
            return mod
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = hooked
    _installed = True
