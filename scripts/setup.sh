#!/usr/bin/env bash
# Creates .venv and installs the kit's requirements. Needs only python3.
# A torch that python3 can already import (your CUDA or ROCm build) is used as it is; otherwise
# the CPU build of torch 2.13.0 is installed, never the multi-GB CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0

if ! command -v "$PYTHON" >/dev/null; then
  echo "error: $PYTHON not found; install Python 3.10+ first" >&2
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    echo "setup: using the torch already installed for $PYTHON ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
    "$PYTHON" -m venv --system-site-packages .venv
  else
    "$PYTHON" -m venv .venv
  fi
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch $TORCH_VERSION (CPU build)"
  if ! "${PIP[@]}" "torch==$TORCH_VERSION+cpu"; then
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      "${PIP[@]}" "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
    else
      echo "error: no CPU build of torch $TORCH_VERSION found by pip. Install the torch build for your" >&2
      echo "       GPU into $PYTHON (see pytorch.org), or set TORCH_INDEX_URL to a CPU wheel index, then run 'make setup'." >&2
      exit 2
    fi
  fi
fi
echo "setup: installing requirements.txt"
"${PIP[@]}" -r requirements.txt
.venv/bin/python -c "import torch, transformers; print(f'setup: ready (torch {torch.__version__}, transformers {transformers.__version__})')"
touch .venv/.installed
