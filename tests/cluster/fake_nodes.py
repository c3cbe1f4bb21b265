"""A Ray cluster on this machine whose worker nodes come and go with demand: a head started by
`ray start --head --autoscaling-config` with Ray's fake multi-node provider (its autoscaler
launches each worker node as a raylet of this machine when resource demand is pending, and
stops one idle for `idle_timeout_minutes`): what `ray.cluster_utils.AutoscalingCluster` builds,
made here because that class cannot run in this Ray or on this machine:

- Ray 2.60's wheel lacks `autoscaler/_private/fake_multi_node/example.yaml`, the base config the
  class reads (FileNotFoundError in its constructor), so the whole config is written here;
- its `start` and `shutdown` run `ray stop --force`, which ends every Ray on the machine. This
  cluster has a HOME, temp dir and port of its own, and is stopped by its processes' session.

The autoscaler is Ray's v1 (the monitor's `StandardAutoscaler`): v2 reads the same missing file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.cluster import free_port

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120
HEAD_TYPE = "ray.head.default"


def autoscaling_config(head_resources: dict[str, float], worker_types: dict[str, dict], gcs_address: str,
                       idle_timeout_s: float) -> dict:
    """The fake multi-node provider's cluster config (the keys the v1 autoscaler reads)."""
    return {
        "cluster_name": "fake_multinode", "max_workers": sum(t["max_workers"] for t in worker_types.values()),
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {HEAD_TYPE: {"resources": head_resources, "node_config": {}, "max_workers": 0}, **worker_types},
        "head_node_type": HEAD_TYPE, "upscaling_speed": 1.0, "idle_timeout_minutes": idle_timeout_s / 60,
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


@dataclass(frozen=True)
class WorkerNode:
    started_s: float  # Unix time, as the GCS recorded it
    ended_s: float  # 0 while it is alive
    death_reason: str  # NodeDeathInfo's: EXPECTED_TERMINATION for one the (v1) autoscaler stopped, idle


class FakeNodesCluster:
    """The head (no resources but `head_resources`) at `address`; worker nodes of `worker_types`
    (Ray's `available_node_types` entries: resources, min_workers, max_workers) launched by its
    autoscaler. `env` goes to every Ray process (the Serve settings); `head_labels`: the head's
    Ray node labels, "key=value,...". """

    def __init__(self, base: Path, port: int, head_resources: dict[str, float], worker_types: dict[str, dict],
                 idle_timeout_s: float, env: dict[str, str], head_labels: str = "") -> None:
        self.base, self.address = base, f"127.0.0.1:{port}"
        (base / "tmp").mkdir(parents=True, exist_ok=True)
        config_path = base / "autoscaling.json"
        config_path.write_text(json.dumps(autoscaling_config(head_resources, worker_types, self.address, idle_timeout_s)))
        self.env = {**os.environ, **env, "HOME": str(base), "TMPDIR": str(base / "tmp"), "RAY_ADDRESS": "",
                    "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        head_cpus = head_resources.get("CPU", 0)
        custom = {k: v for k, v in head_resources.items() if k != "CPU"}
        ports = [arg for flag in ("--dashboard-port", "--dashboard-agent-listen-port", "--ray-client-server-port")
                 for arg in (flag, str(free_port()))]  # not Ray's defaults: another Ray on the machine may hold them
        command = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port), *ports,
                   "--num-cpus", str(int(head_cpus)), "--temp-dir", str(base / "ray"), "--disable-usage-stats",
                   "--include-dashboard", "false", "--autoscaling-config", str(config_path),
                   *(["--resources", json.dumps(custom)] if custom else []), *(["--labels", head_labels] if head_labels else [])]
        self.log = (base / "head.log").open("w")
        self.head = subprocess.Popen(command, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def driver(self, script: str, timeout_s: float = 60) -> str:
        """`script`'s stdout, run by a short Python driver connected to this cluster."""
        prelude = f"import json, ray; ray.init(address={self.address!r}, logging_level='ERROR', log_to_driver=False)\n"
        done = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True, text=True, timeout=timeout_s,
                              env=self.env)
        if done.returncode != 0:
            raise RuntimeError(f"driver failed ({done.returncode}): {done.stderr[-2000:]}")
        return done.stdout

    def worker_nodes(self, is_alive: bool = True) -> dict[str, WorkerNode]:
        """The nodes other than the head, alive (or no longer), by id, as the GCS lists them (no
        driver: no process of this test joins the cluster)."""
        from ray._raylet import GcsClient
        from ray.core.generated.common_pb2 import NodeDeathInfo
        from ray.core.generated.gcs_pb2 import GcsNodeInfo

        state = GcsNodeInfo.GcsNodeState.ALIVE if is_alive else GcsNodeInfo.GcsNodeState.DEAD
        nodes = GcsClient(address=self.address).get_all_node_info(timeout=30, state_filter=state).values()
        return {n.node_id.hex(): WorkerNode(n.start_time_ms / 1000, n.end_time_ms / 1000, NodeDeathInfo.Reason.Name(n.death_info.reason))
                for n in nodes if not n.is_head_node}

    def wait_until_up(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.driver("pass")
                return
            except (RuntimeError, subprocess.TimeoutExpired):
                if self.head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the head did not start:\n" + (self.base / "head.log").read_text()[-3000:]) from None
                time.sleep(2)

    def pids(self) -> list[int]:
        """Every process of this cluster: those of the head's session (`ray start` and what it started,
        the autoscaler's worker nodes included), and any naming its temp dir (in case one left it)."""
        session, marker = self.head.pid, str(self.base)  # start_new_session: its session id is its pid
        found: set[int] = set()
        for process in psutil.process_iter(["pid", "cmdline"]):
            try:
                if os.getsid(process.info["pid"]) == session or any(marker in p for p in process.info["cmdline"] or ()):
                    found.add(process.info["pid"])
            except (ProcessLookupError, PermissionError):
                continue
        found.discard(os.getpid())
        return sorted(found)

    def stop(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.head.wait(30)
        self.log.close()
