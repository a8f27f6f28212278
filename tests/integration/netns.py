"""A private IPv4 LAN of Linux network namespaces, for running the daemons on separate "hosts".

    root namespace (the test process) --veth--+
    host namespace "broker"           --veth--+-- bridge in a "switch" namespace
    host namespace "w1", "w2", ...    --veth--+

Every host is a namespace with `lo` up and one veth (`eth0`) with its own address in a /24 of
10.231.0.0/16 that no interface of the root namespace uses yet. The switch-side end of each veth is
a port of the bridge; setting it down (`cut`) is pulling that host's cable: its TCP connections see
neither packets nor resets until `restore`. The bridge lives in its own namespace, so the only thing
added to the root namespace is the test's own veth. All names carry a per-run tag (the pid), and
`close()` removes everything even half-built; a process started in a namespace must be stopped first.

Needs root, `ip` (iproute2) and a kernel with veth and bridge support: `unavailable()` says why not.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .cluster import Daemon

SUBNETS = ipaddress.IPv4Network("10.231.0.0/16")  # the /24s of a LAN are taken from here
IP_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """An `ip` command failed: the message has the command and its stderr."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS`; its stdout. Raises NetnsError on failure when `check`."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot build a LAN (a skip reason), or None when it can.

    Tries what `Lan` does, in a throwaway namespace: create it, a bridge and a veth pair in it."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, or in a container with CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"ssprobe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    try:
        ip("-n", probe, "link", "add", "br0", "type", "bridge")
        ip("-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "b0")
    except (NetnsError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a bridge and a veth pair in a namespace: {e}"
    finally:
        ip("netns", "delete", probe, check=False)
    return None


def free_subnet(start: int) -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that no address or route of the root namespace overlaps, trying from the `start`th."""
    taken = [net for line in ip("-4", "-o", "addr", "show").splitlines() for net in networks(line)]
    taken += [net for line in ip("-4", "route", "show", "table", "all").splitlines() for net in networks(line)]
    subnets = list(SUBNETS.subnets(new_prefix=24))
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(net) for net in taken):
            return candidate
    raise NetnsError(f"every /24 of {SUBNETS} is in use")


def networks(line: str) -> list[ipaddress.IPv4Network]:
    """The IPv4 networks and addresses named in a line of `ip` output ("default" is not one)."""
    found: list[ipaddress.IPv4Network] = []
    for word in line.split():
        try:
            found.append(ipaddress.IPv4Network(word, strict=False))
        except ValueError:
            continue
    return found


@dataclass(frozen=True)
class Host:
    """One namespace on the LAN."""

    name: str  # short: "broker", "w1"
    netns: str  # the namespace's name
    address: str  # its IPv4 address on the LAN
    port: str  # the bridge port (switch-side veth end) its cable plugs into


class Lan:
    """A bridge in a switch namespace, host namespaces on it, and the root namespace on it as `root_address`."""

    def __init__(self, tag: str | None = None) -> None:
        self.tag = tag or str(os.getpid())
        self.switch = f"ss-{self.tag}-switch"
        self.root_link = f"ss{self.tag}"[:15]  # the root namespace's veth end (names are 15 bytes at most)
        self.hosts: dict[str, Host] = {}
        self._namespaces: list[str] = []
        self.subnet = free_subnet(int(self.tag) if self.tag.isdigit() else 0)
        self._addresses = self.subnet.hosts()
        self.root_address = ""
        try:
            self._build_switch()
        except BaseException:
            self.close()
            raise

    def _build_switch(self) -> None:
        self._add_namespace(self.switch)
        ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        ip("-n", self.switch, "link", "set", "br0", "up")
        # The root namespace's end is made there, its peer straight in the switch: no name clash in root.
        ip("link", "delete", self.root_link, check=False)  # a leftover of a killed run with the same pid
        ip("link", "add", self.root_link, "type", "veth", "peer", "name", "root", "netns", self.switch)
        self.root_address = str(next(self._addresses))
        ip("addr", "add", f"{self.root_address}/{self.subnet.prefixlen}", "dev", self.root_link)
        ip("link", "set", self.root_link, "up")
        self._plug("root")

    def add_host(self, name: str) -> Host:
        """A namespace with `lo` up and `eth0` on the LAN."""
        netns = f"ss-{self.tag}-{name}"
        self._add_namespace(netns)
        ip("-n", netns, "link", "set", "lo", "up")
        port = f"to-{name}"[:15]
        ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        address = str(next(self._addresses))
        ip("-n", netns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        self._plug(port)
        host = self.hosts[name] = Host(name, netns, address, port)
        return host

    def cut(self, name: str) -> None:
        """Pull the host's cable: its bridge port goes down."""
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "down")

    def restore(self, name: str) -> None:
        ip("-n", self.switch, "link", "set", self.hosts[name].port, "up")

    def close(self) -> None:
        """Delete every namespace (their veths and the bridge go with them) and the root namespace's veth.
        Best effort: runs whatever state the LAN is in. Processes in the namespaces must be gone first,
        or a namespace lives on (unnamed) until they exit."""
        ip("link", "delete", self.root_link, check=False)
        for netns in reversed(self._namespaces):
            ip("netns", "delete", netns, check=False)
        self._namespaces.clear()

    def _add_namespace(self, netns: str) -> None:
        ip("netns", "delete", netns, check=False)  # a leftover of a killed run with the same pid
        ip("netns", "add", netns)
        self._namespaces.append(netns)

    def _plug(self, port: str) -> None:
        ip("-n", self.switch, "link", "set", port, "master", "br0")
        ip("-n", self.switch, "link", "set", port, "up")


class NetnsDaemon(Daemon):
    """A Daemon (tests/integration/cluster.py) started with `ip netns exec NETNS`, which execs the
    interpreter: the process, its pid and its signals are the daemon's own."""

    def __init__(self, netns: str, module: str, args: list[str], log: Path) -> None:
        super().__init__(module, args, log, python=("ip", "netns", "exec", netns, sys.executable))
