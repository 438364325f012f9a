"""A worker's training batches, drawn against the epoch budget shared by all workers.

:class:`BudgetedLoader` wraps the rank's own loader (Lightning's, with its distributed sampler)
and ends the epoch when the server's pool of batches is spent, not when the rank's own share is:

1. the first batch of an epoch begins the epoch at the server with this rank's number of
   batches (``len(loader)``);
2. each batch uses one granted batch (:meth:`ParameterClient.take_batch`; with ``deferred``,
   reserved when fetched and spent when it starts); without a grant and with the pool spent,
   iteration stops;
3. a fast worker that runs past its own share starts its loader again with a fresh shuffle (the
   sampler's epoch moved by a large prime per pass), while a slow one stops early: every sample
   of the epoch is still seen about once in expectation.

The wrapper deliberately has no ``__len__``: the number of batches of this rank is not known in
advance, and Lightning then validates exactly when the iterator ends. A loader without a length
(an iterable dataset) is passed through: the rank trains on its own data to the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from lightning_parallel.parameter_server.client import ParameterClient

__all__: list[str] = []

_RESHUFFLE_STRIDE = 1_000_003


def _length(loader: Iterable[Any]) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return None


def _sampler_epoch(loader: Any) -> int | None:
    for sampler in _samplers(loader):
        if hasattr(sampler, "epoch"):
            return int(sampler.epoch)
    return None


def _samplers(loader: Any) -> list[Any]:
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates = [getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)]
    return [sampler for sampler in candidates if sampler is not None]


def _reshuffle(loader: Any, passes: int, base_epoch: int | None) -> int | None:
    """Move the loader's sampler to a fresh order for another pass in the same epoch."""
    for sampler in _samplers(loader):
        if hasattr(sampler, "set_epoch"):
            if base_epoch is None:
                base_epoch = int(getattr(sampler, "epoch", 0))
            sampler.set_epoch(base_epoch + passes * _RESHUFFLE_STRIDE)
            return base_epoch
    return base_epoch


class BudgetedLoader:
    """Iterate ``loader`` while the epoch budget grants batches to this worker.

    Args:
        loader: this rank's training loader.
        client: returns the rank's :class:`ParameterClient` (looked up at each epoch, so the
            loader may be built before the client).
        limit: at most this many batches of this rank count towards the epoch's pool
            (``limit_train_batches``); ``None``: all.
        deferred: only reserve a grant when a batch is fetched
            (:meth:`ParameterClient.reserve_batch`); the trainer spends it when the batch
            starts (:meth:`ParameterClient.start_batch`) and skips a batch whose grant went to
            a faster worker. For loaders that fetch ahead (Lightning prefetches one batch).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        client: Callable[[], ParameterClient],
        limit: int | None = None,
        deferred: bool = False,
    ) -> None:
        self.loader = loader
        self._client = client
        self.limit = limit
        self.deferred = deferred
        self.current: _BudgetedIterator | None = None

    @property
    def sampler(self) -> Any:
        return getattr(self.loader, "sampler", None)

    @property
    def batch_sampler(self) -> Any:
        return getattr(self.loader, "batch_sampler", None)

    @property
    def dataset(self) -> Any:
        return getattr(self.loader, "dataset", None)

    def epoch_batches(self) -> int | None:
        """This rank's batches per epoch, ``None`` when the loader has no length."""
        length = _length(self.loader)
        if length is None:
            return None
        return min(length, self.limit) if self.limit is not None else length

    def __iter__(self) -> Iterator[Any]:
        self.current = _BudgetedIterator(self, self._client())
        return self.current

    def stale(self) -> bool:
        """Whether the live iterator drew batches in an order the sampler has since left.

        Lightning prefetches the first batch of a loader without length when it sets up the
        data, which on resume happens before it moves the sampler to the resumed epoch; the
        strategy then re-creates the iterator (its batches go back to the epoch's pool).
        """
        current = self.current
        if current is None or current.sampler_epoch is None or current.client.steps_this_epoch:
            return False
        return current.sampler_epoch != _sampler_epoch(self.loader)


class _BudgetedIterator(Iterator[Any]):
    def __init__(self, owner: BudgetedLoader, client: ParameterClient) -> None:
        self.owner = owner
        self.client = client
        self.batches = owner.epoch_batches()
        self.iterator: Iterator[Any] | None = None
        self.begun = False
        self.passes = 0
        self.base_epoch: int | None = None
        self.sampler_epoch: int | None = None

    def __next__(self) -> Any:
        if not self.begun:
            self.begun = True
            self.client.begin_epoch(
                self.batches or 0, reserving=self.batches is not None and self.owner.deferred
            )
        if self.batches is not None:
            client = self.client
            granted = client.reserve_batch() if self.owner.deferred else client.take_batch()
            if not granted:
                raise StopIteration
        if self.iterator is None:
            self.sampler_epoch = _sampler_epoch(self.owner.loader)
            self.iterator = iter(self.owner.loader)
        try:
            return next(self.iterator)
        except StopIteration:
            if not self.batches:
                raise
        # this worker is faster than its share: another pass over its data, freshly shuffled
        self.passes += 1
        self.base_epoch = _reshuffle(self.owner.loader, self.passes, self.base_epoch)
        self.iterator = iter(self.owner.loader)
        return next(self.iterator)
