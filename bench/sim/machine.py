"""What a real run on this machine needs beside the server: a redis-server of its own, and where the
machine's CPU time went meanwhile (ours, the shard replicas' among it, and other processes'), since
on a shared machine other processes' load changes every figure."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from collections.abc import Sequence

import psutil  # a Ray dependency
import redis

from bench.cluster import free_port

OTHERS_SHARE = 0.05  # of the machine's busy time, beyond which other processes' load is warned of


class PrivateRedis:
    """A redis-server on a free port, nothing saved; stopped by its pid."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt install redis-server)")
        self.port = free_port()
        self.process = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(10)


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy since boot (not idle, not waiting for I/O or stolen)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


REPLICA_PROCESS = "ServeReplica:loraplex:shard-"  # a shard replica's Ray actor, in its command line


def own_cpu_s(pids: Sequence[int]) -> tuple[float, float]:
    """CPU seconds of this process, its children that ended (the load tester, calibrate) and the
    process trees under `pids` (serve and Ray's processes, redis-server) still running; and of
    those, the shard replicas' processes'."""
    total = sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    replicas = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in tree:
            try:
                times = proc.cpu_times()
                is_replica = any(REPLICA_PROCESS in part for part in proc.cmdline())
            except psutil.Error:  # gone meanwhile
                continue
            total += times.user + times.system
            replicas += (times.user + times.system) if is_replica else 0.0
    return total, replicas


class CPUShare:
    """Where the machine's busy CPU time between `__init__` and `done` went: ours (the replicas, the
    rest) and other processes'."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = pids
        self.started_s, self.busy_s, (self.own_s, self.replicas_s) = time.monotonic(), machine_busy_s(), own_cpu_s(pids)

    def done(self) -> tuple[str, bool]:
        """What it says, and whether other processes took more than OTHERS_SHARE of the busy time."""
        wall_s = time.monotonic() - self.started_s
        own_s, replicas_s = own_cpu_s(self.pids)
        busy_s, own_s, replicas_s = machine_busy_s() - self.busy_s, own_s - self.own_s, replicas_s - self.replicas_s
        others_s = max(0.0, busy_s - own_s)
        split = f" (the replicas {replicas_s:.0f}, the rest {own_s - replicas_s:.0f})" if replicas_s else ""
        return (f"{busy_s:.0f} CPU s busy of {wall_s * (os.cpu_count() or 1):.0f}; ours {own_s:.0f}{split}, "
                f"other processes' {others_s:.0f}"), others_s > OTHERS_SHARE * busy_s
