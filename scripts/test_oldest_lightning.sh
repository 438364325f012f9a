#!/usr/bin/env bash
# The compat subset (tests/test_compat.py: every private Lightning name we use, registration,
# public names, one multi-process fit per strategy family) on the oldest supported
# pytorch-lightning, in its own venv (.venv-oldest). CI runs it after the whole suite, which runs
# on the newest pytorch-lightning and lightning. Keep OLDEST equal to the floor in pyproject.toml
# and lightning_parallel/compat/private.py (SUPPORTED, CHECKED).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=2.4.0
PYTHON=${PYTHON:-python3}
[ -x .venv-oldest/bin/python ] || "$PYTHON" -m venv .venv-oldest
. .venv-oldest/bin/activate
python -m pip install --quiet --upgrade pip
. scripts/install_torch.sh
python -m pip install --quiet -e . "pytorch-lightning==$OLDEST" "pytest>=8" "pytest-timeout>=2.2" "pytest-xdist>=3.5"
python -c "import pytorch_lightning as pl; assert pl.__version__ == '$OLDEST', pl.__version__; print('pytorch-lightning', pl.__version__)"
python -m pytest tests/test_compat.py
