"""gcache.bench.torchvision_stub: opt-in, and only sglang's own modules get the stub."""

import importlib.util
import subprocess
import sys

import pytest

CHECK = r"""
import builtins, importlib.util, sys
real = builtins.__import__
import sglang_adapter, sglang_adapter.config, sglang_adapter.keys, sglang_adapter.window
assert builtins.__import__ is real, "importing the adapter must not touch the import system"
from gcache.bench import torchvision_stub
torchvision_stub.install()
torchvision_stub.install()  # idempotent
inside = {"__name__": "sglang.srt.configs.fake"}
exec("import torchvision.transforms as T\nfrom torchvision.transforms import InterpolationMode\n"
     "mode = InterpolationMode.BICUBIC", inside)
assert type(inside["T"]).__name__ == "_Stub" and inside["mode"]() is not None
for outside in ({"__name__": "__main__"}, {"__name__": "sglangx.mod"}, {"__name__": "router.x"}):
    try:
        exec("import torchvision", outside)
        raise SystemExit(f"{outside['__name__']} got a torchvision")
    except ModuleNotFoundError:
        pass
assert importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules
print("ok")
"""


def test_only_sglang_importers_get_the_stub_and_find_spec_still_says_absent():
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the stub's premise does not hold")
    p = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]
