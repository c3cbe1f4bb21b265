"""A Ray cluster over the hosts of a `Network` (bench/cluster/netns.py): the head on the root
namespace's address on the network (where the test, Redis and the S3 server also run), a worker
node on each host, each with its own HOME and Ray temp dir. Stopped by pid: a test never runs
`ray stop`, which would end every Ray on the machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench.cluster.netns import Host, Network

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120


class RayNodes:
    def __init__(self, network: Network, port: int, head_cpus: int = 2, head_labels: str = "") -> None:
        """`head_labels`: Ray node labels of the head, "key=value,..." """
        self.network, self.port = network, port
        self.address = f"{network.address}:{port}"
        self.head_dir = network.root / "head"
        (self.head_dir / "tmp").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HOME": str(self.head_dir), "TMPDIR": str(self.head_dir / "tmp")}
        subprocess.run([RAY, "start", "--head", "--node-ip-address", network.address, "--port", str(port), "--num-cpus", str(head_cpus),
                        "--temp-dir", str(self.head_dir / "ray"), "--disable-usage-stats", "--include-dashboard", "false",
                        *(["--labels", head_labels] if head_labels else [])],
                       env=env, check=True, capture_output=True, timeout=START_TIMEOUT_S)

    def add_worker(self, host: Host, num_cpus: int = 2) -> None:
        self.network.run(host, [RAY, "start", "--address", self.address, "--node-ip-address", host.address, "--num-cpus", str(num_cpus),
                                "--temp-dir", str(host.home / "ray"), "--disable-usage-stats"],
                         check=True, capture_output=True, timeout_s=START_TIMEOUT_S)

    def head_pids(self) -> list[int]:
        """The head's processes: every one whose command line names its temp dir or this cluster's
        address, and everything they started (the dashboard's agents name neither)."""
        markers = (str(self.head_dir / "ray"), self.address)
        found: set[int] = set()
        for process in psutil.process_iter(["pid", "cmdline"]):
            if any(marker in part for part in process.info["cmdline"] or () for marker in markers):
                found.add(process.info["pid"])
                try:
                    found.update(child.pid for child in process.children(recursive=True))
                except psutil.Error:
                    pass
        return sorted(found)

    def wait_for_nodes(self, count: int, timeout_s: float = 60) -> list[str]:
        """The alive nodes' addresses, once there are `count` of them (asked by a short driver)."""
        import json

        script = ("import json, ray; ray.init(address=%r, logging_level='ERROR'); "
                  "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))") % self.address
        deadline = time.monotonic() + timeout_s
        while True:
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                  env={**os.environ, "HOME": str(self.head_dir), "RAY_ADDRESS": ""})
            alive = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else []
            if len(alive) >= count or time.monotonic() > deadline:
                return alive
            time.sleep(1)

    def stop(self) -> None:
        for host in self.network.hosts.values():
            self.network.kill(host)
        for pid in self.head_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
