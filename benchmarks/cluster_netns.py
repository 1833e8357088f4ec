"""An emulated Ethernet cluster on one machine, built from network namespaces (needs root and ``ip``).

Topology: one "switch" namespace holding a Linux bridge, and per node a namespace whose ``eth0`` is one
end of a veth pair; the other end is enslaved to the bridge inside the switch namespace. Every link is
shaped in both directions (``eth0`` and its bridge port) by ``tc``: a ``tbf`` at the link rate, under a
``netem`` delay when one is asked for. Addresses come from a private /24 that exists only inside these
namespaces; nothing is created in the calling (root) namespace, so traffic only ever flows between the
cluster's own namespaces.

``/etc/netns/<namespace>/hosts`` (bind-mounted over ``/etc/hosts`` by ``ip netns exec``) maps every node
name and the machine's own hostname to that node's address: Horovod 0.28.1 binds its process-set Gloo
devices to whatever the hostname resolves to, ignoring ``HOROVOD_GLOO_IFACE``.

Every namespace name starts with ``hvdcomp-bench-<pid>-``; ``remove_stale()`` deletes those of dead pids
(a previous run that was killed before it could clean up).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

PREFIX = "hvdcomp-bench-"
NETNS_ETC = Path("/etc/netns")
SUBNET = "10.213.47"  # a /24 that exists only inside the cluster's namespaces
INTERFACE = "eth0"
_COUNTER = itertools.count()  # several clusters per run (one per rate) get distinct names
RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """``"1gbit"``, ``"100mbit"``, ``"2.5gbit"`` (tc's decimal units) -> bits per second; ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)\s*", text.lower())
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: expected a positive number and a unit of {sorted(RATE_UNITS)}, e.g. 1gbit")
    return int(float(match.group(1)) * RATE_UNITS[match.group(2)])


def why_unavailable() -> str | None:
    """Why a cluster cannot be built here (not root, no ``ip`` or ``tc``), or None if it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc shaping)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2) on PATH"
    return None


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")


def our_namespaces() -> list[str]:
    """Names of the namespaces that any run of this benchmark created and that still exist."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    shutil.rmtree(NETNS_ETC / name, ignore_errors=True)


def remove_stale() -> list[str]:
    """Delete the namespaces (and their /etc/netns files) left by runs whose process is gone; return them."""
    stale = []
    for name in our_namespaces():
        owner = name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _delete_namespace(name)
            stale.append(name)
    for leftover in NETNS_ETC.glob(f"{PREFIX}*") if NETNS_ETC.is_dir() else ():
        owner = leftover.name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            shutil.rmtree(leftover, ignore_errors=True)
    return stale


class Cluster:
    """``nodes`` namespaces behind one switch, every link shaped to ``rate`` (tc syntax, e.g. ``"1gbit"``)
    plus an optional one-way ``delay`` (netem syntax, e.g. ``"1ms"``) in each direction.

    Use as a context manager, or call ``build()`` then ``teardown()`` (idempotent; call it in ``finally``).
    ``exec_prefix(i)`` is the argv prefix that runs a command inside node ``i``; ``address(i)`` its IPv4
    address; ``node_name(i)`` its host name (resolvable inside every node).
    """

    def __init__(self, nodes: int, rate: str, delay: str | None = None) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be in 1..250, got {nodes}")
        self.nodes, self.rate, self.delay = nodes, rate, delay
        self.rate_bps = parse_rate(rate)
        self.tag = f"{PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.switch = f"{self.tag}-sw"
        self.namespaces = [f"{self.tag}-n{i}" for i in range(nodes)]
        self._created: list[str] = []

    @staticmethod
    def node_name(index: int) -> str:
        return f"node{index}"

    def address(self, index: int) -> str:
        return f"{SUBNET}.{index + 1}"

    def exec_prefix(self, index: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[index]]

    def _shape(self, namespace: str, device: str) -> None:
        """tbf at the link rate (burst: 4 ms of traffic, at least 64 KiB), under netem when delayed."""
        burst = max(64 * 1024, self.rate_bps // 8 * 4 // 1000)
        tbf = ["tbf", "rate", self.rate, "burst", str(burst), "latency", "100ms"]
        if self.delay is None:
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf)
            return
        try:
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem",
                 "delay", self.delay)
        except RuntimeError as error:
            raise RuntimeError(f"delay {self.delay!r} needs tc netem (kernel module sch_netem): {error}") from None
        _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:", "handle", "2:", *tbf)

    def _hosts_file(self, index: int) -> str:
        lines = ["127.0.0.1 localhost", f"{self.address(index)} {socket.gethostname()}"]
        lines += [f"{self.address(i)} {self.node_name(i)}" for i in range(self.nodes)]
        return "\n".join(lines) + "\n"

    def build(self) -> Cluster:
        _run("ip", "netns", "add", self.switch)
        self._created.append(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for index, namespace in enumerate(self.namespaces):
            _run("ip", "netns", "add", namespace)
            self._created.append(namespace)
            port = f"port{index}"
            _run("ip", "link", "add", INTERFACE, "netns", namespace, "type", "veth", "peer", "name", port,
                 "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", namespace, "addr", "add", f"{self.address(index)}/24", "dev", INTERFACE)
            _run("ip", "-n", namespace, "link", "set", "lo", "up")
            _run("ip", "-n", namespace, "link", "set", INTERFACE, "up")
            self._shape(namespace, INTERFACE)
            self._shape(self.switch, port)
            etc = NETNS_ETC / namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self._hosts_file(index))
        return self

    def teardown(self) -> None:
        """Delete every namespace this cluster created (their veths and qdiscs go with them) and their files."""
        while self._created:
            _delete_namespace(self._created.pop())

    def __enter__(self) -> Cluster:
        try:
            return self.build()
        except BaseException:
            self.teardown()
            raise

    def __exit__(self, *exc: object) -> None:
        self.teardown()
