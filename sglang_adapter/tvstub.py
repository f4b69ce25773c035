"""Test/bench-only: let sglang's config modules import on a CPU-only machine.

PyPI's torchvision is CUDA-linked and fails to import beside the CPU torch, yet sglang's
config package imports ``torchvision.transforms`` at import time (only multimodal code calls
it). :func:`install` wraps ``builtins.__import__`` so that ``import torchvision...`` yields an
inert stub, while nothing is put in ``sys.modules`` and no finder is registered, so
``importlib.util.find_spec("torchvision")`` still reports it absent and sglang's feature
checks take their no-torchvision branches. Never used by the adapter itself.
"""

from __future__ import annotations

import builtins
import types
from typing import Any

_STUBBED = "torchvision"
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


_ROOT = _Stub(_STUBBED)


def install() -> None:
    """Idempotent. Only ``torchvision`` and its submodules are affected."""
    global _installed
    if _installed:
        return
    real_import = builtins.__import__

    def hooked(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if level == 0 and (name == _STUBBED or name.startswith(_STUBBED + ".")):
            if not fromlist:
                return _ROOT
            mod = _ROOT
            for part in name.split(".")[1:]:
                mod = getattr(mod, part)
            return mod
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = hooked
    _installed = True
