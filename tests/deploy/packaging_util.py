"""What the packaging tests share: pyproject's requirements, constraints.txt's pins, sglang's set."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SGLANG_REQUIRES = ROOT / "tests" / "data" / "sglang-0.5.23-requires.txt"

# sglang 0.5.23 requirements that exist only for CUDA (kernels, CUDA bindings, the CUDA torch and
# the packages pinned to it). A CPU host replaces them with the CPU torch below.
CUDA_ONLY = frozenset(canonicalize_name(n) for n in (
    "torch", "torchaudio", "torchcodec", "cuda-python", "flash-attn-4", "flashinfer-python", "humming-kernels",
    "nvidia-cutlass-dsl", "nvidia-mathdx", "nvshmem4py-cu13", "quack-kernels", "sgl-deep-ep", "sgl-deep-gemm",
    "sgl-flash-mla", "sglang-kernel", "tilelang", "torch-memory-saver",
))
CPU_TORCH = "torch==2.13.0+cpu"


def pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def requirements(extra: str | None = None) -> list[Requirement]:
    proj = pyproject()["project"]
    raw = proj["dependencies"] if extra is None else proj["optional-dependencies"][extra]
    return [Requirement(r) for r in raw]


def constraints(path: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """canonical name -> pinned version."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line)
        assert m, f"constraints.txt: {line!r} is not NAME==VERSION"
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def sglang_requirements() -> list[Requirement]:
    out = []
    for line in SGLANG_REQUIRES.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate():
                out.append(req)
    return out


def sglang_cpu_requirement_lines() -> list[str]:
    """sglang 0.5.23's own requirement set as it installs on a CPU host."""
    return [str(r) for r in sglang_requirements() if canonicalize_name(r.name) not in CUDA_ONLY] + [CPU_TORCH]


def lowest_pins() -> list[str]:
    """NAME==LOWER for every runtime requirement: the oldest set pyproject.toml admits."""
    out = []
    for req in requirements():
        lows = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lows) == 1, f"{req}: needs exactly one lower bound"
        out.append(f"{req.name}=={lows[0]}")
    return out
