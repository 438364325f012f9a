"""Loopback ports for the tests' process groups, free of races between pytest-xdist workers.

Kept apart from :mod:`helpers.distributed` (and its imports) so that ``conftest.py`` can give
Lightning's launchers these ports in every environment the tests run in.
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_port"]


def _port_block() -> range:
    """The loopback ports this test process hands out: below the kernel's ephemeral range, and
    one block for each pytest-xdist worker.

    A port the kernel picked (bind to port 0) could be given to another socket between the
    check and the store's listen: a gloo pair, or another worker's store. Then rank 0 cannot
    listen and the other ranks talk to a stranger ("Connection closed by peer"). Below the
    ephemeral range the kernel hands nothing out, and the workers' blocks do not overlap.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low, high = (int(part) for part in handle.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    start, stop = (10000, low) if low - 10000 >= 65536 - high else (high + 1, 65536)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    count = max(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")), index + 1)
    size = (stop - start) // count
    return range(start + index * size, start + (index + 1) * size)


_next_port = [os.getpid()]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now and no other test process
    picks: the next free one of this worker's block (:func:`_port_block`), in turn."""
    block = _port_block()
    if len(block) < 64:  # no room outside the ephemeral range: let the kernel pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    for _ in range(len(block)):
        _next_port[0] += 1
        port = block[_next_port[0] % len(block)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {block}")
