"""The Hylo hook's background thread: jobs in order, and the processor time they take."""

from __future__ import annotations

import threading
import time

import pytest

from lightning_parallel.compression.background import BackgroundThread
from lightning_parallel.compression.telemetry import StepAverages


def _run(thread: BackgroundThread, job: object) -> None:
    done = threading.Event()
    thread.submit(job)  # type: ignore[arg-type]
    thread.submit(done.set)
    assert done.wait(10)


def test_jobs_run_in_submission_order() -> None:
    thread, order = BackgroundThread(), []
    for index in range(20):
        thread.submit(lambda index=index: order.append(index))
    _run(thread, lambda: None)
    assert order == list(range(20))


def test_the_thread_counts_processor_time_and_not_waiting() -> None:
    thread = BackgroundThread()

    def spin() -> None:  # 0.1 s of this thread's processor time, however long it takes
        started = time.thread_time()
        while time.thread_time() - started < 0.1:
            pass

    _run(thread, lambda: time.sleep(0.2))
    slept = thread.cpu_seconds
    _run(thread, spin)
    assert slept < 0.05
    assert 0.1 <= thread.cpu_seconds - slept < 0.15


def test_step_averages_count_from_the_first_steady_step_and_restart_with_a_new_thread() -> None:
    thread, averages = BackgroundThread(), StepAverages()
    averages.add_tail(9.0)  # before counting began: not counted
    assert averages.gauges(step=3) == {}
    thread.cpu_seconds = 1.0
    averages.step_begins(thread, step=2)
    averages.add_tail(0.010)
    thread.cpu_seconds = 1.5
    averages.step_begins(thread, step=3)  # the same thread: counting goes on
    averages.add_tail(0.030)
    thread.cpu_seconds = 1.7
    assert averages.gauges(step=4) == {
        "hylo/thread_cpu_ms": pytest.approx(350.0),
        "hylo/tail_ms": pytest.approx(20.0),
    }
    averages.step_begins(BackgroundThread(), step=4)  # after a fork: a new thread, a new count
    assert averages.gauges(step=4) == {}
