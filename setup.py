"""Build hook: a wheel carries the ``lightning.pytorch`` build of the Lightning layer.

Everything else is in ``pyproject.toml``. The build (``lightning_parallel/lightning/strategies``
...) is written from the source by ``lightning_parallel/compat/generate.py``, loaded here by
path because nothing is installed yet. An editable install needs no hook: importing
``lightning_parallel.lightning`` writes the files next to the source when they are missing.
"""

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_GENERATOR = Path(__file__).parent / "lightning_parallel" / "compat" / "generate.py"


class BuildWithLightningLayer(build_py):
    """``build_py``, then the ``lightning.pytorch`` build written into the build folder."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        spec = importlib.util.spec_from_file_location("_lightning_parallel_generate", _GENERATOR)
        assert spec is not None and spec.loader is not None
        generator = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generator)
        source = Path(__file__).parent / "lightning_parallel"
        generator.write(source, Path(self.build_lib) / "lightning_parallel")


setup(cmdclass={"build_py": BuildWithLightningLayer})
