#!/usr/bin/env bash
# Create .venv (if missing) and install lightning_parallel with its development tools.
#
# PyTorch comes first and on its own: a torch that is already importable is kept; otherwise
# torch 2.13.0 is installed (a local CPU wheel on CPU-only build machines; set TORCH_INDEX_URL,
# e.g. to PyTorch's CPU index, to choose the build elsewhere). Installing it before the package
# keeps pip from resolving an unpinned torch to the newest release with its CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
. scripts/install_torch.sh
# torchvision pairs with one torch release: the torch just installed stays (a constraint), and pip
# picks the torchvision (and timm) made for it
constraints=$(mktemp)
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" >"$constraints"
python -m pip install --quiet -e ".[dev]" -c "$constraints"
rm -f "$constraints"
# PyPI's torchvision is built for CUDA torch; beside a CPU-only torch, a hook makes it import
python scripts/torchvision_cpu.py
# the lightning.pytorch build of the Lightning layer, next to its source (git-ignored)
python -m lightning_parallel.compat.generate >/dev/null
python -c "import lightning_parallel, torch; print('lightning_parallel', lightning_parallel.__version__, 'torch', torch.__version__)"
