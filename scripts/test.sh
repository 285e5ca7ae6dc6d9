#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, then the whole test suite on CPU.
set -euo pipefail
# NOTE: bytecode caches are written even where PYTHONDONTWRITEBYTECODE is set (in the venv and in
# the checkout's __pycache__ folders, which git ignores). Without them every process recompiles
# what it imports: about 1.3 s more CPU for each rank that imports superneurons and 8-10 s for
# each that imports transformers and TRL, over the ninety-odd processes the test suite starts.
unset PYTHONDONTWRITEBYTECODE
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
cd "$ROOT"
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/ruff" format --check src tests benchmarks examples
# NOTE: mypy runs beside the tests. Without its cache (a fresh checkout) it spends about two
# minutes of one core in the sources of transformers, torch, lightning and peft; run before the
# tests, it left CI's second core idle that long.
MYPY_LOG="$(mktemp)"
trap 'rm -f "$MYPY_LOG"' EXIT
"$VENV/bin/mypy" >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
# Two workers (pytest-xdist): CI's two cores. Tests of one xdist_group (the network-namespace
# tests, tests/conftest.py) share a worker. A later -n in "$@" wins (-n 0: one process).
status=0
"$VENV/bin/python" -m pytest -n 2 --dist loadgroup "$@" || status=$?
mypy_status=0
wait "$MYPY_PID" || mypy_status=$?
cat "$MYPY_LOG"
[ "$mypy_status" = 0 ] || echo "mypy failed (exit $mypy_status)" >&2
exit $(( status != 0 ? status : mypy_status ))
