"""Run a function on N processes joined by a gloo process group, with a timeout.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes, initialises
``torch.distributed`` with the gloo backend on a free loopback port, calls
``fn(rank, world_size, *args)`` in each and returns the list of results ordered by rank. A child
that raises makes the call raise with the child's traceback; a child that does not finish in
``timeout`` seconds is killed and the call raises ``TimeoutError`` with every live rank's
Python stacks: a distributed test never hangs the suite, and a hang says where it stood.

The children come from a fork server by default: a clean process that imported torch, Lightning
and the package once and forks each child, so that no thread of the pytest process (a progress
bar's monitor, a logger's writer, a gloo thread of an earlier test) can hold a lock at fork time
that a child then waits on forever. The function and its arguments travel by cloudpickle, so a
closure or a local function works as under plain fork.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers.ports import free_port

#: what the fork server imports once for every child it forks
PRELOAD = [
    "torch",
    "torch.distributed",
    "pytorch_lightning",
    "lightning_parallel.strategies",
    "lightning_parallel.callbacks",
    "helpers.distributed",
]


def start_fork_server() -> None:
    """Start the fork server, if it is not running, with :data:`PRELOAD` imported.

    Lightning and the package are imported there once, not again by each child (~4 s of CPU
    each; importing them starts no thread). A test timing a run calls this first, so that it
    measures the run, not the server's first start (seconds on a busy machine).
    """
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()


def _child(
    job: bytes,
    rank: int,
    world_size: int,
    port: int,
    queue: Any,
    init_group: bool,
    stacks: str,
) -> None:
    # on SIGUSR1 (sent by the parent at its timeout) every thread's stack goes to a file, so that
    # a hang reports where each rank stood
    stack_file = open(os.path.join(stacks, f"rank{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
            )
        fn, args = pickle.loads(job)
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()


def _stacks(processes: list[Any], alive: list[int], stacks: str) -> str:
    """Where each rank still running stands: its threads' Python stacks (SIGUSR1)."""
    for rank in alive:
        if processes[rank].pid is not None:
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(2.0)
    parts = []
    for rank in alive:
        try:
            with open(os.path.join(stacks, f"rank{rank}.txt")) as handle:
                parts.append(f"--- rank {rank} ---\n{handle.read()[-6000:]}")
        except OSError:
            parts.append(f"--- rank {rank}: no stack ---")
    return "\n".join(parts)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    start_method: str = "forkserver",
    init_group: bool = True,
    may_vanish: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank.

    ``may_vanish``: ranks that may die or freeze without a result (fault tests); their result
    is ``None``, and the call returns once every other rank has answered.
    """
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        start_fork_server()
    job = cloudpickle.dumps((fn, args))  # closures and local functions too
    queue = context.Queue()
    port = free_port()
    stacks = tempfile.mkdtemp(prefix="stacks-")
    processes = [
        context.Process(
            target=_child,
            args=(job, rank, world_size, port, queue, init_group, stacks),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        required = set(range(world_size)) - set(may_vanish)
        while not required <= results.keys():
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except Exception as error:  # queue.Empty
                alive = [r for r, p in enumerate(processes) if p.is_alive()]
                raise TimeoutError(
                    f"distributed run did not finish in {timeout:.0f} s; ranks still running: "
                    f"{alive}; results so far from {sorted(results)}\n"
                    + _stacks(processes, alive, stacks)
                ) from error
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for process in processes:
            process.join(timeout=5 if not failures else 1)
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        shutil.rmtree(stacks, ignore_errors=True)
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results.get(rank) for rank in range(world_size)]
