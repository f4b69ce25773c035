#!/usr/bin/env bash
# Install the real sglang 0.5.23 package (CPU-only) into a virtualenv, for the
# sglang_adapter tests. Idempotent: returns at once when everything is importable.
#
#   scripts/install_sglang.sh [VENV]      (default .venv)
#
# torch is pinned to the CPU build (a local wheel in /opt/wheels when present, else
# PyPI's CPU index); every other install runs under constraints.txt, which holds it,
# so pip never swaps in a multi-GB CUDA torch. sglang goes in with --no-deps and
# only its import-time needs are added.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${1:-.venv}
PY="$VENV/bin/python"
STAMP="$VENV/.sglang-0.5.23-installed"

if [[ -f "$STAMP" ]] && "$PY" -c "import importlib.util as u; assert all(u.find_spec(m) for m in ('sglang', 'torch', 'openai', 'partial_json_parser'))" \
    2>/dev/null; then
  exit 0
fi

PIP=("$PY" -m pip install -q --disable-pip-version-check)
# the project's pins, torch==2.13.0+cpu among them
CONSTRAINTS="$ROOT/constraints.txt"

if ! "$PY" -c "import torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
  echo "installing torch 2.13.0 (CPU)"
  # The CPU wheel from a local wheel directory / configured index when one holds it (this
  # machine: /opt/wheels), else from PyTorch's CPU index (PyPI's own torch is the CUDA build).
  "${PIP[@]}" "torch==2.13.0+cpu" -c "$CONSTRAINTS" 2>/dev/null \
    || "${PIP[@]}" --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0+cpu" -c "$CONSTRAINTS"
fi

echo "installing sglang 0.5.23 (no deps) and its import-time needs"
"${PIP[@]}" --no-deps "sglang==0.5.23"
# the list lives in pyproject.toml's `sglang` extra
"${PIP[@]}" -c "$CONSTRAINTS" -e "$ROOT[sglang]"

"$PY" -c "import torch, openai, partial_json_parser, sglang.srt.mem_cache.hicache_storage" >/dev/null
touch "$STAMP"
echo "sglang 0.5.23 ready in $VENV"
