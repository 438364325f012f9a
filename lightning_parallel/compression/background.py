"""The Hylo hook's background thread: bucket exchanges run in order, off the backward pass.

DDP calls the communication hook from the backward pass. On the CPU the hook hands each bucket
to one daemon thread per process, so that the exchange's waits overlap with the rest of the
backward pass. All of a hook's collectives are issued from this one thread, one bucket after the
other, in DDP's bucket order: gloo matches collectives by issue order, so every rank stays in
step.

The thread counts the processor time its jobs take (:attr:`BackgroundThread.cpu_seconds`, from
``time.thread_time``): on a host whose cores are all busy with the backward pass, that is time
the backward pass loses to the exchange, whatever the overlap.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

__all__: list[str] = []


class BackgroundThread:
    """One daemon thread that runs jobs in submission order (a fresh one after ``fork``: a
    thread does not survive it, so :attr:`pid` tells whose it is)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.cpu_seconds = 0.0  # processor time of the jobs run so far
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hylo-exchange", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after every job submitted before it."""
        self._jobs.put(job)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            started = time.thread_time()
            job()
            self.cpu_seconds += time.thread_time() - started
