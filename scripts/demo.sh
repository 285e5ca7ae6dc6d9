#!/usr/bin/env bash
# The README's main-job command: set up (idempotent), then `superneurons demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
cd "$ROOT"
exec "$VENV/bin/superneurons" demo "$@"
