#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, then the whole test suite on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
cd "$ROOT"
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/ruff" format --check src tests benchmarks examples
"$VENV/bin/mypy"
# Two workers (pytest-xdist): CI's two cores. Tests of one xdist_group (the network-namespace
# tests, tests/conftest.py) share a worker. A later -n in "$@" wins (-n 0: one process).
"$VENV/bin/python" -m pytest -n 2 --dist loadgroup "$@"
