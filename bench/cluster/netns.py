"""Hosts on this one machine for multi-node tests: a bridge in the root network namespace and one
namespace per host, each joined to it by a veth pair, so every host has its own address and a
link that can be cut (`ip link set ... down`). Needs root and iproute2 (CI runs as root).

Processes started on a host run in its namespace (`ip netns exec`), with their own HOME and
temp dirs (nothing of one host's is on another's paths); `kill` ends every process in a
namespace by pid, as losing the machine would. Everything is named with a token of its own and
removed by `close`, whatever state the test left it in. A run that was killed cannot close: a
network it left on the same subnet, with no process left in its namespaces, is removed by the
next one (it would answer for the new hosts' addresses); one still in use is an error that says so.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def available() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "multi-node tests need root (network namespaces)"
    if shutil.which("ip") is None:
        return "multi-node tests need iproute2's `ip`"
    return None


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["netns", "exec", namespace, "ip"] if namespace else []), *args]
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=30)


def _clear_stale(address: str) -> None:
    """Remove the network a killed run left holding `address` (its bridge and namespaces), or raise
    when something else holds it, or a process still runs in one of its namespaces."""
    holders = [line.split()[1] for line in _ip("-o", "-4", "addr", "show").stdout.splitlines()
               if f" {address}/" in line]
    for device in holders:
        ours = re.fullmatch(r"lpx([0-9a-f]{4})br", device)
        namespaces = [line.split()[0] for line in _ip("netns", "list").stdout.splitlines()]
        mine = [ns for ns in namespaces if ours and ns.startswith(f"lpx{ours.group(1)}")]
        busy = [ns for ns in mine if _ip("netns", "pids", ns, check=False).stdout.split()]
        if not ours or busy:
            why = f"processes run in {', '.join(busy)}" if busy else "not a test network"
            raise RuntimeError(f"{address} is already on {device} ({why}): another network on this subnet is in use; "
                               "give this one another subnet")
        for ns in mine:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", device, check=False)


@dataclass
class Host:
    name: str  # the namespace
    address: str
    veth: str  # the root namespace's end of its link: down cuts the host off
    home: Path  # its own HOME and temp dirs live here


class Network:
    def __init__(self, root: Path, subnet: str = "10.77.0") -> None:
        """A bridge with address `subnet`.1/24 in the root namespace; hosts get .11, .12, ..."""
        self.token = secrets.token_hex(2)
        self.root, self.subnet = root, subnet
        self.bridge = f"lpx{self.token}br"
        self.address = f"{subnet}.1"  # the root namespace's own address on the network
        self.hosts: dict[str, Host] = {}
        _clear_stale(self.address)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.address}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, label: str) -> Host:
        index = len(self.hosts) + 1
        name, veth = f"lpx{self.token}{label}", f"lpx{self.token}v{index}"
        peer = f"{veth}p"
        address = f"{self.subnet}.{10 + index}"
        _ip("netns", "add", name)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", name)
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        _ip("addr", "add", f"{address}/24", "dev", peer, namespace=name)
        _ip("link", "set", peer, "up", namespace=name)
        _ip("link", "set", "lo", "up", namespace=name)
        home = self.root / label
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        host = self.hosts[label] = Host(name, address, veth, home)
        return host

    def env(self, host: Host, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on `host`: its own HOME and TMPDIR."""
        return {**os.environ, "HOME": str(host.home), "TMPDIR": str(host.home / "tmp"), **(extra or {})}

    def run(self, host: Host, argv: Sequence[str], extra_env: Mapping[str, str] | None = None, timeout_s: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.name, *argv], env=self.env(host, extra_env), timeout=timeout_s,
                              **kwargs)

    def pids(self, host: Host) -> list[int]:
        out = _ip("netns", "pids", host.name, check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: Host) -> int:
        """SIGKILL every process on `host` (the machine is lost); how many there were."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def cut(self, host: Host) -> None:
        """Take `host`'s link down: it runs on, unreachable."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")

    def close(self) -> None:
        for host in self.hosts.values():
            self.kill(host)
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.name, check=False)
        _ip("link", "del", self.bridge, check=False)
