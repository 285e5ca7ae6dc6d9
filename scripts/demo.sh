#!/usr/bin/env bash
# The README's main-job command: set up (idempotent), then `superneurons demo`.
set -euo pipefail
# NOTE: bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (in the venv and in
# the checkout's __pycache__ folders, which git ignores). Without them every process recompiles
# what it imports: about 1.3 s more CPU for each rank that imports superneurons and 8-10 s for
# each process that imports transformers and TRL.
unset PYTHONDONTWRITEBYTECODE
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
cd "$ROOT"
exec "$VENV/bin/superneurons" demo "$@"
