"""Packaging that installs beside an engine: ranges in pyproject.toml, exact pins only in
constraints.txt, a light ``import gcache``, ``gcache --version``, a wheel that builds."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.packaging_util import (
    CPU_TORCH,
    ROOT,
    constraints,
    lowest_pins,
    pyproject,
    requirements,
    sglang_cpu_requirement_lines,
    sglang_requirements,
)

# extras that mirror another project's exact pins on purpose
MIRRORS = {"sglang"}


def all_requirements() -> list[tuple[str, Requirement]]:
    extras = pyproject()["project"]["optional-dependencies"]
    return [("dependencies", r) for r in requirements()] + [
        (e, r) for e in extras for r in requirements(e)]


def test_runtime_dependencies_are_ranges_with_a_lower_bound():
    for req in requirements():
        ops = {s.operator for s in req.specifier}
        assert "==" not in ops and "===" not in ops, f"{req}: exact pins belong in constraints.txt"
        assert ">=" in ops, f"{req}: give the lowest tested version as a lower bound"
    assert len(lowest_pins()) == len(requirements())


def test_no_extra_pins_exactly_except_mirrors():
    for where, req in all_requirements():
        if where in MIRRORS:
            continue
        assert not any(s.operator == "==" for s in req.specifier), f"[{where}] {req}: pin it in constraints.txt"


def test_every_constraint_pin_satisfies_pyproject():
    pins = constraints()
    for where, req in all_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"[{where}] {req.name} has no pin in constraints.txt"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside [{where}] {req}"


def test_ranges_admit_sglang_0_5_23_pins():
    """Where sglang pins a package gcache also needs, gcache's range holds that version; where
    sglang gives a range, the version CI tests with satisfies it too."""
    ours = {canonicalize_name(r.name): r for _, r in all_requirements()}
    pins = constraints()
    checked = 0
    for theirs in sglang_requirements():
        name = canonicalize_name(theirs.name)
        if name not in ours:
            continue
        exact = [s.version for s in theirs.specifier if s.operator == "=="]
        for v in exact:
            assert ours[name].specifier.contains(v, prereleases=True), f"sglang needs {theirs}, gcache allows {ours[name]}"
        if not exact and name != "torch":
            assert theirs.specifier.contains(pins[name], prereleases=True), \
                f"constraints.txt pins {name}=={pins[name]}, sglang needs {theirs}"
        checked += 1
    assert checked >= 5  # numpy, msgpack-free?, xxhash, tqdm, prometheus-client, torch, ...
    # the torch extra admits both sglang's CUDA torch and the CPU torch CI runs
    torch = next(r for r in requirements("torch"))
    assert torch.specifier.contains("2.14.1") and torch.specifier.contains(CPU_TORCH.split("==")[1])


def test_sglang_cpu_set_drops_only_cuda_packages():
    lines = sglang_cpu_requirement_lines()
    names = {canonicalize_name(Requirement(line).name) for line in lines}
    assert CPU_TORCH in lines and "numpy" in names and "transformers" in names
    assert not names & {"flashinfer-python", "sglang-kernel", "cuda-python"}


def test_make_ci_and_sglang_script_install_under_constraints():
    make = (ROOT / "Makefile").read_text()
    assert "-c constraints.txt -e" in make
    assert 'CONSTRAINTS="$ROOT/constraints.txt"' in (ROOT / "scripts" / "install_sglang.sh").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_version_flag_matches_the_package():
    from gcache import __version__

    p = subprocess.run([sys.executable, "-m", "gcache", "--version"], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == f"gcache {__version__}"


def test_import_gcache_stays_light():
    code = ("import sys, gcache; heavy = [m for m in ('grpc', 'torch', 'pysyncobj', 'prometheus_client', "
            "'cryptography', 'numpy') if m in sys.modules]; print(','.join(heavy)); "
            "assert gcache.Status.OK is not None and gcache.GCacheError")
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "", f"import gcache pulled in {p.stdout.strip()}"
    # the client is still there on first use
    p = subprocess.run([sys.executable, "-c", "import gcache; print(gcache.Client.__name__)"],
                       check=False, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "Client", p.stderr


def test_wheel_builds_with_ranges_and_entry_points(tmp_path):
    """``python -m build`` (no isolation: the venv's setuptools, no downloads) makes a wheel whose
    metadata carries the ranges and whose entry points are the two commands."""
    pytest.importorskip("build", reason="the dev extra's `build` is not installed")
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path / "dist"
    p = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(src)],
                       check=False, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    from gcache import __version__

    (wheel,) = out.glob("gcache-*.whl")
    assert wheel.name.startswith(f"gcache-{__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = Parser().parsestr(z.read(f"gcache-{__version__}.dist-info/METADATA").decode())
        entry = z.read(f"gcache-{__version__}.dist-info/entry_points.txt").decode()
    assert "gcache/cli.py" in names and "router/cli.py" in names and "sglang_adapter/backend.py" in names
    assert not any(n.startswith("tests/") for n in names)
    reqs = [Requirement(r) for r in meta.get_all("Requires-Dist")]
    base = [r for r in reqs if r.marker is None]
    assert {canonicalize_name(r.name) for r in base} == {canonicalize_name(r.name) for r in requirements()}
    assert all(">=" in str(r.specifier) for r in base)
    assert "gcache = gcache.cli:main" in entry and "gcache-router = router.cli:main" in entry


def test_lowest_pins_are_installable_names():
    for pin in lowest_pins():
        req = Requirement(pin)
        assert str(req.specifier).startswith("==")
    assert Path(ROOT / "constraints.txt").exists()
