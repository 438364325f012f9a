#!/usr/bin/env bash
# Sourced by the install scripts, inside an activated venv: install PyTorch 2.13.0 unless a torch
# is already importable (a local CPU wheel on CPU-only build machines; set TORCH_INDEX_URL, e.g.
# to PyTorch's CPU index, to choose the build elsewhere). Installing it before the package keeps
# pip from resolving an unpinned torch to the newest release with its CUDA packages.
if ! python -c "import torch" 2>/dev/null; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    python -m pip install --quiet "torch==2.13.0" --index-url "$TORCH_INDEX_URL"
  else
    python -m pip install --quiet "torch==2.13.0"
  fi
fi
