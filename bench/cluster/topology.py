"""The multi-node topology on this one machine, as the multi-node test and `loraplex bench-cluster`
run it: a Ray head on the bridge's address (where Redis, the S3 server and `loraplex serve` also
run), worker nodes each on a host of its own (netns.py: its own address, HOME and temp dirs), a
6-process Redis Cluster and moto's S3. `serving` runs `loraplex serve` joined to that Ray cluster,
as an operator's would. Everything started is stopped by `close`, by pid, whatever state it is in.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.cluster import free_port, netns
from bench.cluster.ray_nodes import RayNodes
from bench.cluster.redis_cluster import LocalRedisCluster
from bench.cluster.s3_server import S3Server
from bench.server import Server

START_TIMEOUT_S = 240  # loraplex serve, to "ready"
STOP_TIMEOUT_S = 60


class Topology:
    def __init__(self, head_cpus: int = 1, head_labels: str = "", subnet: str = "10.77.0") -> None:
        """`subnet`: the network's /24 (netns.Network): another than a topology running beside this one's."""
        missing = netns.available()
        if missing is not None:
            raise RuntimeError(missing)
        self.root = Path(tempfile.mkdtemp(prefix="lpx", dir="/tmp"))  # short: Ray's socket paths live under it
        self.network = netns.Network(self.root, subnet)
        self._stops: list = []
        self._saved_env: dict[str, str | None] = {}
        try:
            self.redis = LocalRedisCluster(self.root / "redis", host=self.network.address).start()
            self._stops.append(self.redis.stop)
            self.s3 = S3Server(host=self.network.address).start()
            self._stops.append(self.s3.stop)
            self.bucket = f"lpx-{uuid.uuid4().hex[:8]}"
            import boto3

            aws = self.s3.env()
            boto3.client("s3", endpoint_url=aws["AWS_ENDPOINT_URL"], aws_access_key_id="testing", aws_secret_access_key="testing",
                         region_name="us-east-1").create_bucket(Bucket=self.bucket)
            self._saved_env = {k: os.environ.get(k) for k in aws}
            os.environ.update(aws)  # the Ray nodes started below pass them on to the replicas
            self.ray = RayNodes(self.network, free_port(), head_cpus=head_cpus, head_labels=head_labels)
            self._stops.append(self.ray.stop)
        except BaseException:
            self.close()
            raise

    @property
    def hosts(self) -> list[netns.Host]:
        return list(self.network.hosts.values())

    def add_worker(self, label: str, num_cpus: int = 2) -> netns.Host:
        """A new host with a Ray worker node on it, once Ray counts it alive."""
        host = self.network.add_host(label)
        self.ray.add_worker(host, num_cpus=num_cpus)
        wanted = len(self.network.hosts) + 1
        if len(self.ray.wait_for_nodes(wanted)) < wanted:
            raise RuntimeError(f"Ray did not count the node on {host.address} alive")
        return host

    def config(self, model: str | None, model_name: str, **sections) -> dict:
        """A `loraplex serve` config for this topology: the Redis Cluster, the S3 store, each node's own
        adapter cache; `sections` replace or add top-level keys."""
        return {
            "model": model, "model_name": model_name,
            "cache": {"redis_url": self.redis.url, "redis_cluster": True, "key_prefix": f"lpx-{uuid.uuid4().hex[:8]}",
                      "chunk_tokens": 32},
            "registry": {"store_url": f"s3://{self.bucket}/adapters", "store_dir": "~/.cache/loraplex/adapters", "copies": 2,
                         "poll_interval_s": 0.5},
            "fingerprint_dir": None,
            "state": {"ephemeral": True},  # in the cache's cluster: a test bed, not a bill
            **sections,
        }

    @contextmanager
    def serving(self, config: dict) -> Iterator[Server]:
        """`loraplex serve` on the head, joined to this Ray cluster, until the block ends (then Ctrl-C)."""
        env = {**os.environ, "RAY_ADDRESS": self.ray.address, "HOME": str(self.ray.head_dir)}
        server = Server(config, self.root, config["http"]["port"], START_TIMEOUT_S, env=env, url_host=self.network.address)
        try:
            yield server
        finally:
            server.stop(STOP_TIMEOUT_S)

    def gateway_log(self) -> str:
        """What the Ray workers on the head, the gateway replica's among them, wrote to stderr so far."""
        return "".join(p.read_text(errors="replace") for p in (self.ray.head_dir / "ray").rglob("worker-*.err"))

    def close(self) -> None:
        for stop in reversed(self._stops):
            try:
                stop()
            except Exception as e:  # noqa: BLE001 - the rest must still be stopped
                print(f"cleanup: {e!r}", file=sys.stderr)
        self._stops = []
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.network.close()
        shutil.rmtree(self.root, ignore_errors=True)
