"""This package's Lightning layer built for ``lightning.pytorch`` (``import lightning as L``).

``lightning_parallel.lightning.strategies``, ``.callbacks``, ``.demo.models``, ``.demo.data``
and ``.cli`` are the modules of ``lightning_parallel.strategies`` ... loaded a second time with
``pytorch_lightning`` mapped to ``lightning.pytorch`` (see :mod:`lightning_parallel.compat.layer`).
Import from here to name the ``lightning.pytorch`` classes explicitly; the names at the top of
``lightning_parallel`` choose the build that matches your code by themselves.
"""

from lightning_parallel.compat.layer import install_finder

install_finder()

__all__: list[str] = []
