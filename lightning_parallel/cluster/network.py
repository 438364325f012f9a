"""Build N simulated hosts on one machine: network namespaces behind shaped veth links.

Each host is a Linux network namespace with one veth interface whose peer is a port of a
bridge in the root namespace (a star around one switch). Every link is shaped with ``tc``:

1. host egress (inside the namespace): ``netem delay L`` as root qdisc with a token bucket
   ``tbf rate B`` as its child, so that every packet a host sends waits ``L`` and the host
   sends at most ``B`` bits/s (the netem + tbf recipe of the netem documentation);
2. host ingress (the bridge port's egress in the root namespace): ``tbf rate B``, so that a
   host also *receives* at most ``B`` bits/s, like a full-duplex NIC of that speed, even when
   several peers send to it at once.

The one-way latency between two hosts is therefore ``L`` (RTT ``2L``). Kernels built without
``sch_netem`` cannot delay packets: the network then shapes the rate only, says so in
:attr:`SimulatedNetwork.notes` and a ``RuntimeWarning``, and reports
``latency_emulated = False``.

Names start with ``lp<pid hex>r<run hex>`` (namespaces ``...h<i>``, bridge ``...br``, bridge
ports ``...b<i>``), so that each run is unique and a later run can find and remove the
leftovers of a run whose process died (:func:`remove_stale`: the owner pid no longer runs, or
runs a process that started after the namespace was made, i.e. a reused pid). Addresses
come from a private ``10.x.y.0/24`` chosen per run; the bridge has no address, so nothing in
the root namespace's routing changes.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from dataclasses import dataclass
from types import TracebackType

from lightning_parallel.cluster.units import parse_bandwidth, parse_latency

__all__: list[str] = []

_NAME = re.compile(r"^lp([0-9a-f]+)r([0-9a-f]+)(h\d+|b\d+|br)$")
_RUNS = itertools.count()
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"])
_MAX_HOSTS = 250


class ClusterError(RuntimeError):
    """The simulated cluster cannot be set up or run; the message names the fix."""


def _tool(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def check_requirements() -> tuple[str, str]:
    """Paths of ``ip`` and ``tc``, after checking that this process may create namespaces.

    Raises:
        ClusterError: not root, or iproute2's ``ip``/``tc`` missing; the message says which.
    """
    problems = []
    if os.geteuid() != 0:
        problems.append(
            "root is required: network namespaces (ip netns), veth links and tc shaping need "
            "CAP_NET_ADMIN; run the command as root (e.g. with sudo)"
        )
    ip, tc = _tool("ip"), _tool("tc")
    missing = [name for name, path in (("ip", ip), ("tc", tc)) if path is None]
    if missing:
        problems.append(
            f"iproute2 is missing ({' and '.join(missing)} not found); install it, "
            "e.g. `apt-get install iproute2`"
        )
    if problems:
        raise ClusterError("cannot build the simulated cluster: " + "; ".join(problems))
    assert ip is not None and tc is not None
    return ip, tc


def netns_unavailable_reason() -> str | None:
    """Why a simulated cluster cannot run here (not root, no iproute2), or ``None`` if it can."""
    try:
        check_requirements()
    except ClusterError as error:
        return f"netns: {error}"
    return None


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
    return result


def _process_start(pid: int) -> float | None:
    """Epoch seconds at which process ``pid`` started (``None`` if unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as system:
            boot = next(int(line.split()[1]) for line in system if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _owner_alive(pid: int, created: float | None = None) -> bool:
    """Whether process ``pid`` runs and, given the creation time of a namespace it owns,
    started before it (a process that started later merely reuses a dead owner's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    start = _process_start(pid) if created is not None else None
    return not (created is not None and start is not None and start > created + 2.0)


def _kill_namespace_processes(ip: str, namespace: str) -> None:
    listed = _run([ip, "netns", "pids", namespace], check=False).stdout.split()
    for pid in listed:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            continue


def _namespaces(ip: str) -> list[str]:
    return [line.split()[0] for line in _run([ip, "netns", "list"]).stdout.splitlines() if line]


def _root_links(ip: str) -> list[str]:
    names = []
    for line in _run([ip, "-o", "link", "show"]).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            names.append(parts[1].strip().split("@")[0])
    return names


def remove_stale() -> list[str]:
    """Remove namespaces and links left by simulated clusters whose process is gone.

    Only names of this package's pattern whose owning process no longer runs are touched;
    live runs (this one or another process's) are left alone. Returns the removed names.
    """
    ip, _ = check_requirements()
    removed = []
    stale_runs = set()
    for namespace in _namespaces(ip):
        match = _NAME.match(namespace)
        if not match:
            continue
        try:
            created: float | None = os.stat(f"/run/netns/{namespace}").st_mtime
        except OSError:
            created = None
        if not _owner_alive(int(match.group(1), 16), created):
            _kill_namespace_processes(ip, namespace)
            _run([ip, "netns", "delete", namespace], check=False)
            removed.append(namespace)
            stale_runs.add(match.group(1, 2))
    for link in _root_links(ip):
        match = _NAME.match(link)
        if match and (match.group(1, 2) in stale_runs or not _owner_alive(int(match.group(1), 16))):
            _run([ip, "link", "delete", link], check=False)
            removed.append(link)
    return removed


def leftovers(prefix: str | None = None) -> list[str]:
    """Namespaces and root-namespace links of simulated clusters (of run ``prefix`` if given)."""
    ip, _ = check_requirements()
    found = []
    for name in _namespaces(ip) + _root_links(ip):
        match = _NAME.match(name)
        if match and (prefix is None or f"lp{match.group(1)}r{match.group(2)}" == prefix):
            found.append(name)
    return found


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, interface (inside it), address and bridge port."""

    index: int
    namespace: str
    interface: str
    address: str
    bridge_port: str


def token_bucket_burst_bytes(rate_bits: float) -> int:
    """The bytes a host's token bucket lets through at once after its link idled: it must hold
    a whole GSO super-packet (64 KiB) and ~2 ms of traffic so that the timer granularity does
    not cap the rate. At 10 Mbit/s its 70 kB are 56 ms of the link's time."""
    return max(int(rate_bits / 8.0 * 0.002), 70_000)


class SimulatedNetwork:
    """N hosts in their own network namespaces, linked through one bridge by shaped links.

    Use it as a context manager: the namespaces exist inside the ``with`` block and are removed
    on exit, also after an exception or Ctrl-C. Requires root and iproute2.

    Args:
        hosts: number of hosts (2 or more for anything distributed; at most 250).
        bandwidth: rate of every host's link in each direction, ``tc`` style (``"1gbit"``).
        latency: one-way delay added to every packet a host sends (``"1ms"``, ``"0"``).
        subnet: a private IPv4 ``/24`` for the host addresses (default: one chosen per run).

    Example::

        with SimulatedNetwork(2, "100mbit", "1ms") as network:
            subprocess.run(network.exec_argv(network.hosts[0], ["hostname", "-I"]))
    """

    shaped = True  # links shaped by tc; each host's traffic counted on its bridge port

    def __init__(
        self, hosts: int, bandwidth: str = "1gbit", latency: str = "0", subnet: str | None = None
    ) -> None:
        if not 1 <= hosts <= _MAX_HOSTS:
            raise ValueError(f"hosts must be between 1 and {_MAX_HOSTS}, got {hosts}")
        self.bandwidth = bandwidth
        self.latency = latency
        self.rate_bits = parse_bandwidth(bandwidth)
        self.delay_seconds = parse_latency(latency)
        run = next(_RUNS) % 256
        pid = os.getpid()
        self.prefix = f"lp{pid:x}r{run:x}"
        network = ipaddress.ip_network(
            subnet or f"10.{64 + (pid >> 8) % 160}.{(pid + run) % 256}.0/24"
        )
        if network.prefixlen > 24 or not network.is_private:
            raise ValueError(f"subnet must be a private IPv4 /24 or larger, got {subnet}")
        addresses = list(network.hosts())
        self.bridge = f"{self.prefix}br"
        self.hosts = [
            Host(
                index=i,
                namespace=f"{self.prefix}h{i}",
                interface=f"{self.prefix}h{i}",
                address=str(addresses[i]),
                bridge_port=f"{self.prefix}b{i}",
            )
            for i in range(hosts)
        ]
        self.prefixlen = network.prefixlen
        self.latency_emulated = self.delay_seconds == 0.0
        self.notes: list[str] = []
        self.created = False
        self._netem: bool | None = None
        self._ip = self._tc = ""

    def __enter__(self) -> SimulatedNetwork:
        return self.create()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.destroy()

    def create(self) -> SimulatedNetwork:
        """Create namespaces, bridge, links and shaping; undo everything if a step fails."""
        self._ip, self._tc = check_requirements()
        remove_stale()
        self.created = True
        try:
            self._ip_run("link", "add", self.bridge, "type", "bridge")
            # bridged frames must not traverse the host's iptables (br_netfilter), whose
            # FORWARD policy may drop them
            self._ip_run(
                "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False
            )
            self._ip_run("link", "set", self.bridge, "up")
            for host in self.hosts:
                self._create_host(host)
        except BaseException:
            self.destroy()
            raise
        return self

    def _ip_run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run([self._ip, *args], check=check)

    def _create_host(self, host: Host) -> None:
        ns = host.namespace
        self._ip_run("netns", "add", ns)
        # no IPv6 chatter (router solicitations, MLD) in the interface counters
        _run(
            [self._ip, "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
            check=False,
        )
        _run(
            [self._ip, "netns", "exec", ns, "sysctl", "-qw",
             "net.ipv6.conf.default.disable_ipv6=1"],
            check=False,
        )  # fmt: skip
        self._ip_run(
            "link", "add", host.bridge_port, "type", "veth", "peer", "name", host.interface,
            "netns", ns,
        )  # fmt: skip
        self._ip_run("link", "set", host.bridge_port, "master", self.bridge)
        self._ip_run("link", "set", host.bridge_port, "up")
        self._ip_run("-n", ns, "link", "set", "lo", "up")
        self._ip_run(
            "-n", ns, "addr", "add", f"{host.address}/{self.prefixlen}", "dev", host.interface
        )
        self._ip_run("-n", ns, "link", "set", host.interface, "up")
        self._shape(host)

    def _token_bucket(self) -> list[str]:
        rate_bytes = self.rate_bits / 8.0
        burst = token_bucket_burst_bytes(self.rate_bits)
        # the queue ~20 ms of traffic
        limit = max(int(rate_bytes * 0.02), 4 * burst)
        return ["tbf", "rate", f"{self.rate_bits}bit", "burst", str(burst), "limit", str(limit)]

    def _shape(self, host: Host) -> None:
        ns, dev = host.namespace, host.interface
        parent = ["root", "handle", "1:"]
        if self.delay_seconds > 0 and self._netem is not False:
            delay_us = max(1, round(self.delay_seconds * 1e6))
            netem = _run(
                [self._tc, "-n", ns, "qdisc", "add", "dev", dev, *parent, "netem", "delay",
                 f"{delay_us}us", "limit", "100000"],
                check=self._netem is True,
            )  # fmt: skip
            self._netem = netem.returncode == 0
            if self._netem:
                self.latency_emulated = True
                parent = ["parent", "1:1", "handle", "10:"]
            else:
                note = (
                    f"latency {self.latency} is NOT emulated: this kernel has no netem qdisc "
                    f"(tc said: {netem.stderr.strip()}; it needs CONFIG_NET_SCH_NETEM, "
                    "`modprobe sch_netem`); links are shaped to the bandwidth only"
                )
                self.notes.append(note)
                warnings.warn(note, RuntimeWarning, stacklevel=4)
        _run([self._tc, "-n", ns, "qdisc", "add", "dev", dev, *parent, *self._token_bucket()])
        _run([self._tc, "qdisc", "add", "dev", host.bridge_port, "root", *self._token_bucket()])

    def exec_argv(self, host: Host, argv: list[str]) -> list[str]:
        """The command line that runs ``argv`` inside ``host``'s namespace."""
        if not self.created:
            raise ClusterError("the network is not created; use it as `with SimulatedNetwork(...)`")
        return [self._ip, "netns", "exec", host.namespace, *argv]

    def set_link(self, host: Host, up: bool) -> None:
        """Bring ``host``'s link down (no packet leaves or reaches it) or up again."""
        self._ip_run("link", "set", host.bridge_port, "up" if up else "down")

    def pids(self, host: Host) -> list[int]:
        """Processes that run inside ``host``'s namespace now."""
        listed = _run([self._ip, "netns", "pids", host.namespace], check=False).stdout.split()
        return [int(pid) for pid in listed if pid.isdigit()]

    def tx_bytes(self, host: Host) -> int:
        """Bytes ``host`` has sent so far (its bridge port's receive counter, root namespace)."""
        path = f"/sys/class/net/{host.bridge_port}/statistics/rx_bytes"
        with open(path) as counter:
            return int(counter.read())

    def destroy(self) -> None:
        """Kill every process left in the namespaces and remove namespaces, links and bridge.

        Idempotent and best-effort: each object is removed even if another removal fails.
        """
        if not self.created:
            return
        for host in self.hosts:
            _kill_namespace_processes(self._ip, host.namespace)
            # deleting the root end removes the veth pair at once; namespace deletion alone
            # frees the pair asynchronously, after the call returns
            self._ip_run("link", "delete", host.bridge_port, check=False)
            self._ip_run("netns", "delete", host.namespace, check=False)
        self._ip_run("link", "delete", self.bridge, check=False)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and leftovers(self.prefix):
            time.sleep(0.05)
        self.created = False
