#!/usr/bin/env bash
# The GPU acceptance run in one command (see scripts/gpu_check.py): the cuda tests, the demo on
# one GPU, bench memory (ResNet-50, GPT-2) with every anchor, bench codecs on the GPU and the LLM
# plans, within 9 minutes; one summary in OUTDIR/gpu-check.json and .md.
#   bash scripts/gpu-check.sh OUTDIR             # needs a CUDA device (else: exit 2, one line)
#   bash scripts/gpu-check.sh --dry-run OUTDIR   # lists every step, anywhere
# Installs nothing: the Python in SUPERNEURONS_PYTHON, else ./.venv's, else python3, must have
# torch with CUDA (and pytest); this checkout's sources are used as they are.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${SUPERNEURONS_PYTHON:-}"
if [ -z "$PYTHON" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
