"""A user's file: a subclass of every public strategy and callback, as type checkers see them.

``tests/test_typing.py`` checks it with ``mypy --strict`` and ``pyright`` (strict) as it stands,
for ``lightning.pytorch``, and once more with the imports swapped for ``pytorch_lightning``
(``import pytorch_lightning as pl``, ``from lightning_parallel.pytorch_lightning import ...``).
"""

# pyright: strict
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import Strategy

from lightning_parallel import (
    CommStats,
    GroPipeStrategy,
    HookedDDPStrategy,
    HyloCompression,
    HyloStrategy,
    ModelAveragingStrategy,
    ParameterServerStrategy,
    PowerSGDDDPStrategy,
    SpecTrainStrategy,
    Straggler,
)


class MyGroPipe(GroPipeStrategy):
    def __init__(self, stages: int = 2) -> None:
        super().__init__(stages=stages, micro_batches=8, schedule="gpipe")


class MySpecTrain(SpecTrainStrategy):
    pass


class MyAveraging(ModelAveragingStrategy):
    def __init__(self) -> None:
        super().__init__(period=4)


class MyParameterServer(ParameterServerStrategy):
    pass


class MyHylo(HyloStrategy):
    pass


class MyHookedDDP(HookedDDPStrategy):
    pass


class MyPowerSGD(PowerSGDDDPStrategy):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(rank=4, **kwargs)


class MyCommStats(CommStats):
    def __init__(self) -> None:
        super().__init__(prog_bar=True)


class MyHyloCompression(HyloCompression):
    pass


class MyStraggler(Straggler):
    def __init__(self) -> None:
        super().__init__(rank=1, factor=2.0)


strategies: list[Strategy] = [
    MyGroPipe(stages=4),
    MySpecTrain(stages=2),
    MyAveraging(),
    MyParameterServer(),
    MyHylo(),
    MyHookedDDP(),
    MyPowerSGD(),
]
callbacks: list[pl.Callback] = [MyCommStats(), MyHyloCompression(), MyStraggler()]
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MyGroPipe(), callbacks=callbacks)
stages: int = MyGroPipe().stages
period: int | None = MyAveraging().period
