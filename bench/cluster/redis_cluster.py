"""A private Redis Cluster (3 masters, 1 replica each) on free ports, for tests of cluster mode and failover.

Every node runs in its own directory under the test's tmp_path with persistence off (or, `is_durable`, as a
state store: an append-only file and no eviction) and a node timeout of
1 s, so a killed master's replica takes over about 2-3 s later. `stop` ends every node this helper started,
by pid (so does leaving the `with` block, whatever happened in it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.cluster import key_slot

NODE_TIMEOUT_MS = 1000
BUS_PORT_OFFSET = 10000  # each node also listens on its port + 10000 (the cluster bus)


def free_node_port() -> int:
    """A free port whose cluster bus port (+10000, so at most 65535) is free too."""
    for _ in range(1000):
        with socket.socket() as s, socket.socket() as bus:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port + BUS_PORT_OFFSET > 65535:
                continue
            try:
                bus.bind(("127.0.0.1", port + BUS_PORT_OFFSET))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


@dataclass
class Node:
    port: int
    process: subprocess.Popen
    host: str = "127.0.0.1"

    @property
    def is_alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, *command: str) -> object:
        """One command to this node alone, on a connection of its own."""
        with redis.Redis(host=self.host, port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0) as client:
            return client.execute_command(*command)


class LocalRedisCluster:
    def __init__(self, directory: Path, num_masters: int = 3, replicas_per_master: int = 1, host: str = "127.0.0.1",
                 is_durable: bool = False) -> None:
        """`host`: the address every node binds and announces (another than loopback for hosts in namespaces);
        `is_durable`: every node as a state store runs (append-only file, never evicting: gateway/state.py)."""
        for binary in ("redis-server", "redis-cli"):
            if shutil.which(binary) is None:
                raise RuntimeError(f"{binary} is not installed (apt install redis-server redis-tools)")
        self.directory, self.host = directory, host
        self.num_nodes = num_masters * (1 + replicas_per_master)
        self.replicas_per_master = replicas_per_master
        self.is_durable = is_durable
        self.nodes: dict[int, Node] = {}  # port -> node; killed ones stay until `stop`

    def __enter__(self) -> LocalRedisCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The seed node's URL (the first node's; a client learns the others from it)."""
        return f"redis://{self.host}:{next(iter(self.nodes))}/0"

    def start(self, timeout_s: float = 30.0) -> LocalRedisCluster:
        try:
            self._start(time.monotonic() + timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, deadline: float) -> None:
        for _ in range(self.num_nodes):
            node = self._start_node(deadline)
            self.nodes[node.port] = node
        create = ["redis-cli", "--cluster", "create", *(f"{self.host}:{p}" for p in self.nodes),
                  "--cluster-replicas", str(self.replicas_per_master), "--cluster-yes"]
        done = subprocess.run(create, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}): {done.stdout[-2000:]} {done.stderr[-2000:]}")
        self._wait(self.is_ok, deadline, "the cluster did not reach cluster_state:ok with every replica in sync")

    def _start_node(self, deadline: float, num_tries: int = 5) -> Node:
        """A node on a free port; another port when the chosen one was taken meanwhile (other tests pick ports too)."""
        for _ in range(num_tries):
            port = free_node_port()
            home = self.directory / str(port)
            home.mkdir(parents=True)
            args = ["redis-server", "--port", str(port), "--bind", self.host, "--dir", str(home),
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "",
                    *(("--appendonly", "yes", "--maxmemory-policy", "noeviction") if self.is_durable else ("--appendonly", "no")),
                    "--repl-diskless-sync-delay", "0",  # replicas in sync at once: one that never synced cannot take over
                    "--protected-mode", "yes" if self.host == "127.0.0.1" else "no"]  # else: the test's own private network
            with open(home / "redis.log", "wb") as log:
                node = Node(port, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT), self.host)
            try:
                self._wait(lambda: not node.is_alive or node.ask("PING"), deadline, f"redis-server on port {port} did not start")
            except BaseException:
                node.process.kill()  # not one of `nodes` yet: `stop` would not see it
                node.process.wait(10)
                raise
            if node.is_alive:
                return node
        log_tail = (home / "redis.log").read_text(errors="replace")[-1000:]
        raise RuntimeError(f"no redis-server started in {num_tries} tries; the last one's log ends: {log_tail}")

    def is_ok(self) -> bool:
        """Every live node says cluster_state:ok, every live replica is in sync with its master and online in
        its master's eyes, and every slot's master is alive."""
        for node in self.live_nodes():
            if b"cluster_state:ok" not in node.ask("CLUSTER", "INFO"):
                return False
            replication = node.ask("INFO", "replication")
            if replication["role"] == "slave" and replication["master_link_status"] != "up":
                return False
            replicas = [v for k, v in replication.items() if k.startswith("slave") and isinstance(v, dict)]
            if any(r.get("state") != "online" for r in replicas):  # after a diskless sync a master puts its replica online
                return False  # at the replica's first ACK (up to 1 s after the replica's link is up): WAIT skips it until then
        live = {n.port for n in self.live_nodes()}
        return all(port in live for port in self.masters_by_slots().values())

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.is_alive]

    def masters_by_slots(self) -> dict[tuple[int, int], int]:
        """(first slot, last slot) -> the port of its master, as a live node sees it."""
        for node in self.live_nodes():
            try:
                reply = node.ask("CLUSTER", "SLOTS")
            except redis.RedisError:
                continue
            return {(int(r[0]), int(r[1])): int(r[2][1]) for r in reply}
        raise RuntimeError("no live node answers CLUSTER SLOTS")

    def masters(self) -> set[int]:
        return set(self.masters_by_slots().values())

    def master_of(self, key: str) -> int:
        """The port of the master that owns `key`'s slot now."""
        slot = key_slot(key.encode())
        return next(port for (first, last), port in self.masters_by_slots().items() if first <= slot <= last)

    def replica_of(self, master_port: int) -> int:
        return int(self.nodes[master_port].ask("INFO", "replication")["slave0"]["port"])

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crashed machine: no goodbye to the others)."""
        node = self.nodes[port]
        os.kill(node.process.pid, signal.SIGKILL)
        node.process.wait(10)

    @contextlib.contextmanager
    def paused(self, port: int) -> Iterator[None]:
        """One node stopped (SIGSTOP: connected, answering nothing) for the block, then resumed."""
        pid = self.nodes[port].process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def wait_for_new_master(self, key: str, old_port: int, timeout_s: float) -> int:
        """The port of the node that took `key`'s slot over from `old_port`, once the cluster is ok again."""
        deadline = time.monotonic() + timeout_s
        self._wait(lambda: self.master_of(key) != old_port and self.is_ok(), deadline,
                   f"no replica took over from the master on port {old_port} within {timeout_s} s")
        return self.master_of(key)

    def wait_until_ok(self, timeout_s: float) -> None:
        self._wait(self.is_ok, time.monotonic() + timeout_s, f"the cluster was not ok within {timeout_s} s")

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.is_alive:
                node.process.kill()
                node.process.wait(10)

    @staticmethod
    def _wait(ready: Callable[[], object], deadline: float, failure: str) -> None:
        while True:
            try:
                if ready():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(failure)
            time.sleep(0.05)
