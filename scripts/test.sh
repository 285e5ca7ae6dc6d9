#!/usr/bin/env bash
# The README's test command: set up (idempotent), lint, then the whole test suite on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
cd "$ROOT"
"$VENV/bin/ruff" check src tests benchmarks examples
"$VENV/bin/ruff" format --check src tests benchmarks examples
# NOTE: mypy runs beside the tests: on a fresh checkout (no cache) it is a minute or more of
# one core, and the tests leave some of the CPU idle (ranks starting, interpreters importing).
# Its verdict counts as before; its report is printed after the tests'.
MYPY_LOG="$(mktemp)"
trap 'rm -f "$MYPY_LOG"' EXIT
"$VENV/bin/mypy" >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
# Two workers (pytest-xdist): CI's two cores. Tests of one xdist_group (the network-namespace
# tests, tests/conftest.py) share a worker. A later -n in "$@" wins (-n 0: one process).
TESTS=0
"$VENV/bin/python" -m pytest -n 2 --dist loadgroup "$@" || TESTS=$?
MYPY=0
wait "$MYPY_PID" || MYPY=$?
echo "mypy:"
cat "$MYPY_LOG"
if [ "$TESTS" -ne 0 ]; then exit "$TESTS"; fi
exit "$MYPY"
