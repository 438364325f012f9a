"""Make PyPI's torchvision importable beside a CPU-only torch (a build-machine fix, not part of
the package).

PyPI's torchvision wheel is built against CUDA torch: beside a CPU-only torch its operator
library (``torchvision._C``) does not load, and ``import torchvision`` then fails in its own
fake-kernel registration ("operator torchvision::nms does not exist"). That breaks every
package that imports torchvision when present (timm, transformers, torchmetrics, so Lightning).
The model definitions need none of those operators (they serve detection: ``nms``,
``roi_align``). Elsewhere install torchvision from PyTorch's CPU index instead.

``python scripts/torchvision_cpu.py`` checks ``import torchvision`` in this interpreter and, only
where it fails that way, writes a ``.pth`` hook into site-packages that declares the two
operator schemas torchvision registers unconditionally (``nms``, ``qnms``) just before
torchvision is first imported. Run it again after reinstalling torchvision; ``--remove``
deletes the hook.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

NAME = "lightning_parallel_torchvision_cpu"

HOOK = '''"""Written by scripts/torchvision_cpu.py of lightning_parallel: declares torchvision's
nms and qnms operator schemas before torchvision is first imported, where its CUDA-built
operator library cannot load beside a CPU-only torch."""

import importlib.abc
import sys


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            global LIBRARY
            LIBRARY = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                LIBRARY.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        return None


sys.meta_path.insert(0, _BeforeTorchvision())
'''


def _imports() -> str:
    """The error of ``import torchvision`` in a fresh interpreter ('' if it imports)."""
    run = subprocess.run(
        [sys.executable, "-c", "import torchvision"], capture_output=True, text=True
    )
    return "" if run.returncode == 0 else run.stderr.strip().splitlines()[-1]


def main(argv: list[str]) -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    module, pth = site / f"{NAME}.py", site / f"{NAME}.pth"
    if "--remove" in argv:
        module.unlink(missing_ok=True)
        pth.unlink(missing_ok=True)
        return 0
    error = _imports()
    if not error:
        print("torchvision imports: nothing to do")
        return 0
    if "torchvision::nms does not exist" not in error:
        print(f"torchvision does not import, for another reason: {error}")
        return 1
    module.write_text(HOOK)
    pth.write_text(f"import {NAME}\n")
    error = _imports()
    print("torchvision imports with the hook" if not error else f"still failing: {error}")
    return 0 if not error else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
