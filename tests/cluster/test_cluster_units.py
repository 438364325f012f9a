import os
import time

import pytest

from lightning_parallel.cluster import (
    ClusterError,
    check_requirements,
    format_bandwidth,
    format_memory_size,
    parse_bandwidth,
    parse_latency,
    parse_memory_size,
    parse_straggler,
)
from lightning_parallel.cluster import network as network_module


@pytest.mark.parametrize(
    ("text", "bits"),
    [("1gbit", 10**9), ("100mbit", 10**8), ("2.5Gbit", 25 * 10**8), ("10mbps", 8 * 10**7)],
)
def test_bandwidth_follows_tc_units(text, bits):
    assert parse_bandwidth(text) == bits


@pytest.mark.parametrize("text", ["fast", "1 gigabit", "-1mbit", "1kbit", ""])
def test_bad_bandwidth_names_the_format(text):
    with pytest.raises(ValueError, match="bandwidth"):
        parse_bandwidth(text)


@pytest.mark.parametrize(("text", "seconds"), [("1ms", 1e-3), ("500us", 5e-4), ("0", 0.0)])
def test_latency_units(text, seconds):
    assert parse_latency(text) == pytest.approx(seconds)


def test_bad_latency_names_the_format():
    with pytest.raises(ValueError, match="latency"):
        parse_latency("1 hour")


def test_format_bandwidth_round_trips():
    assert format_bandwidth(parse_bandwidth("250mbit")) == "250mbit"


def test_straggler_option():
    assert parse_straggler("1:3") == (1, 3.0)
    for bad in ("1", "x:2", "-1:2", "0:0.5"):
        with pytest.raises(ValueError, match="RANK:FACTOR"):
            parse_straggler(bad)


def test_without_root_and_iproute2_the_error_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(network_module.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(network_module, "_tool", lambda name: None)
    with pytest.raises(ClusterError) as error:
        check_requirements()
    message = str(error.value)
    assert "root" in message
    assert "iproute2" in message and "ip and tc" in message


def test_a_reused_pid_does_not_keep_a_stale_namespace_alive():
    now = time.time()
    assert network_module._owner_alive(os.getpid(), created=now)
    # a namespace made an hour before this process started cannot be this process's
    assert not network_module._owner_alive(os.getpid(), created=now - 3600)
    assert not network_module._owner_alive(2**22 + 1)  # above pid_max: no such process


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2000MB", 2 * 10**9),
        ("2GB", 2 * 10**9),
        ("1.5GiB", 3 * 2**29),
        ("512 MiB", 512 * 2**20),
        ("300mb", 300 * 10**6),
        ("1048576B", 2**20),
    ],
)
def test_memory_size_units(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["2000", "lots", "1gbit", "-1GB", "2 GB RAM", "", "0.5MB"])
def test_bad_memory_size_names_the_format(text):
    with pytest.raises(ValueError, match="memory size"):
        parse_memory_size(text)


@pytest.mark.parametrize(
    ("size", "text"),
    [(2 * 10**9, "2 GB"), (3 * 2**29, "1.5 GiB"), (700 * 10**6, "700 MB"), (123456789, "123.5 MB")],
)
def test_format_memory_size_is_short_and_exact(size, text):
    assert format_memory_size(size) == text
