#!/usr/bin/env bash
# By hand only, never in setup or CI (it downloads ~3 GB: PyPI's torch 2.4.1 is a CUDA build with
# its NVIDIA libraries; it imports and runs on a CPU-only machine too): the test suite against
# the oldest torch pyproject supports, in a throw-away venv outside the repository.
#   bash scripts/test-torch-floor.sh -m "not slow"     # arguments go to pytest
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${TORCH_FLOOR_VENV:-/tmp/superneurons-torch-2.4}"
PYTHON="${PYTHON:-python3}"
log() { echo "[torch-floor] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV with torch==2.4.1"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.4.1" numpy pytest matplotlib tqdm
fi
log "$("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)')"
cd "$ROOT"
PYTHONPATH="$ROOT/src" "$VENV/bin/python" -m pytest "$@"
