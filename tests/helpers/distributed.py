"""Run a function on N processes joined by a gloo process group, with a timeout.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes (fork by default:
fast, and the function may be a closure or a local), initialises ``torch.distributed`` with the
gloo backend on a free loopback port, calls ``fn(rank, world_size, *args)`` in each and returns
the list of results ordered by rank. A child that raises makes the call raise with the child's
traceback; a child that does not finish in ``timeout`` seconds is killed and the call raises
``TimeoutError``: a distributed test never hangs the suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    queue: Any,
    init_group: bool,
) -> None:
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
        result = fn(rank, world_size, *args)
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    start_method: str = "fork",
    init_group: bool = True,
    may_vanish: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; results by rank.

    ``may_vanish``: ranks that may die or freeze without a result (fault tests); their result
    is ``None``, and the call returns once every other rank has answered.
    """
    context = mp.get_context(start_method)
    queue = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_child, args=(fn, rank, world_size, port, args, queue, init_group), daemon=True
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
                    f"{alive}; results so far from {sorted(results)}"
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
    if failures:
        raise RuntimeError("\n".join(failures))
    return [results.get(rank) for rank in range(world_size)]
