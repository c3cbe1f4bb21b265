"""Nodes follow replicas (issue 50): `loraplex serve` joined to a Ray cluster whose worker nodes
come and go with demand (Ray's fake multi-node provider: its autoscaler launches each worker node
as a raylet on this machine; tests/cluster/fake_nodes.py), as KubeRay's autoscaler adds and
removes worker pods.

The head has no CPU, each worker node one, and a replica of the shard needs one: a replica that
Serve starts for the shard's policy (gateway/cluster/autoscaling.py) fits on no node there is, Ray
keeps it pending, and the autoscaler launches a node for it. A burst scales the shard from one
replica to three: two nodes join, the new replicas run there and answer, no request fails. After
the burst the shard scales back to one, and the two nodes, idle, are removed; the node of the
replica that stays is kept. The times each step took are printed (pytest -s shows them).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.cluster import free_port
from bench.server import ServeFailed, Server
from gateway.cluster.membership import ASLEEP, DRAINING, UP
from gateway.serve import SERVE_ENV
from tests.cluster.fake_nodes import FakeNodesCluster, WorkerNode
from tests.gateway.gateway_setup import digest
from tests.gateway.test_serve_autoscaling import OPERATOR_KEY, Load, routed, wait_for

INGRESS_LABEL = "loraplex.io/ingress"  # the head's: the gateway runs there, never on a node that may go
WORKER_TYPES = {"cpu1": {"resources": {"CPU": 1, "object_store_memory": 100 << 20}, "node_config": {},
                         "min_workers": 1, "max_workers": 3}}
IDLE_TIMEOUT_S = 10.0  # a worker node idle this long is removed (KubeRay's idleTimeoutSeconds)
NODE_WAIT_S = 300.0  # a node's and a replica's start on a loaded 2-core machine
CLIENTS = 8  # 8 KV slots asked for: 4 replicas at 0.5 of a replica's 4 slots, so the max of 3


@contextlib.contextmanager
def fake_cluster() -> Iterator[FakeNodesCluster]:
    """In a short directory of its own: a raylet's socket path must fit in 107 bytes (pytest's tmp_path is too long)."""
    base = Path(tempfile.mkdtemp(prefix="lpx-nodes-", dir="/tmp"))
    try:
        cluster = FakeNodesCluster(base, free_port(), {"CPU": 0}, WORKER_TYPES, IDLE_TIMEOUT_S, SERVE_ENV,
                                   head_labels=f"{INGRESS_LABEL}=yes")
        try:
            cluster.wait_until_up()
            yield cluster
        finally:  # every process of it, by its session, failed or not: none may outlive the test
            cluster.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def serving(config: dict, directory: Path, cluster: FakeNodesCluster) -> Iterator[str]:
    """`loraplex serve` joined to `cluster` (RAY_ADDRESS), as tests/gateway/serve_process.py runs it."""
    port = free_port()
    config = {**config, "http": {**config.get("http", {}), "host": "127.0.0.1", "port": port}}
    try:
        server = Server(config, directory, port, NODE_WAIT_S, env={**cluster.env, "RAY_ADDRESS": cluster.address})
    except ServeFailed as e:
        pytest.fail(str(e))
    try:
        yield server.url
    except BaseException:
        server.stop(60)
        raise
    if not server.stop(60):
        pytest.fail("loraplex serve did not stop on SIGINT")
    assert "shutting down" in "".join(server.output) and server.process.returncode == 0


def health(url: str) -> tuple[dict[str, str], dict[str, str]]:
    """Each replica's phase, and the Ray node id of each replica that answers, as /health reports them."""
    shards = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=30).json()["shards"]
    replicas = [r for shard in shards.values() for r in shard["replicas"]]
    return {r["id"]: r.get("phase", UP) for r in replicas}, {r["id"]: r["node"]["id"] for r in replicas if r.get("node")}


class TimedLoad(Load):
    """Load that also keeps when each replica first answered (its `x-loraplex-replica`), Unix time."""

    def __init__(self, url: str, clients: int) -> None:
        self.first_answer_s: dict[str, float] = {}
        self.started_s = time.time()
        super().__init__(url, clients)

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": self.model, "prompt": f"client {i} request {n}", "max_tokens": 24, "temperature": 0}
                try:
                    answer = client.post(f"{self.url}/v1/completions", json=body)
                except httpx.HTTPError as e:
                    self.statuses.append(type(e).__name__)
                    continue
                self.statuses.append(answer.status_code)
                if answer.status_code == 200:
                    self.first_answer_s.setdefault(answer.headers["x-loraplex-replica"], time.time())
                else:
                    self.errors.append(answer.text[:300])


def wait_nodes(cluster: FakeNodesCluster, num_nodes: int, what: str) -> None:
    """Until there are `num_nodes` worker nodes."""
    started = time.monotonic()
    while len(cluster.worker_nodes()) != num_nodes:
        if time.monotonic() - started > NODE_WAIT_S:
            pytest.fail(f"{what}: not within {NODE_WAIT_S:g} s; worker nodes now {list(cluster.worker_nodes())}")
        time.sleep(1)


def burst(url: str, seen: list[dict[str, str]], nodes: dict[str, str]) -> TimedLoad:
    """A burst of CLIENTS until the shard's three replicas are up and each has taken requests."""
    load, started = TimedLoad(url, clients=CLIENTS), time.monotonic()
    try:
        while time.monotonic() - started < NODE_WAIT_S:
            phases, where = health(url)
            seen.append(phases)
            nodes.update(where)
            if all(phases.get(r) == UP for r in ("s-0", "s-1", "s-2")) and min(routed(url).get(r, 0) for r in ("s-1", "s-2")) >= 3:
                return load
            time.sleep(0.5)
        pytest.fail(f"the shard did not reach three serving replicas within {NODE_WAIT_S:g} s: {seen[-1]}, routed {routed(url)}")
    finally:
        load.stop()


def report(load: TimedLoad, ended_s: float, down_s: float, added: dict[str, WorkerNode], removed: dict[str, WorkerNode]) -> str:
    joined = ", ".join(f"{n.started_s - load.started_s:.1f} s" for n in sorted(added.values(), key=lambda n: n.started_s))
    answered = ", ".join(f"{r} {load.first_answer_s[r] - load.started_s:.1f} s" for r in ("s-1", "s-2"))
    gone = ", ".join(f"{n.ended_s - ended_s:.1f} s ({n.death_reason})" for n in sorted(removed.values(), key=lambda n: n.ended_s))
    return (f"\nafter the burst began ({CLIENTS} clients): worker nodes joined {joined}; first answers from {answered}; "
            f"{len(load.statuses)} requests. After it ended: one replica again {down_s:.1f} s, the nodes removed {gone}")


def test_replicas_that_fit_no_node_bring_worker_nodes_and_the_nodes_go_when_they_end(tiny_llama, tmp_path) -> None:
    config = {"model": str(tiny_llama.path), "model_name": "tiny", "http": {"node_labels": {INGRESS_LABEL: "yes"}},
              "shards": [{"name": "s", "adapters": [], "num_cpus": 1, "autoscaling": {
                  "min_replicas": 1, "max_replicas": 3, "target_utilization": 0.5, "upscale_delay_s": 1.0,
                  "downscale_delay_s": 4.0, "lead_s": 0.0}}],
              "engine": {"num_seq_slots": 4}, "cache": {"redis_url": None}, "state": {"ephemeral": True}, "auth": "none",
              "operator_key_sha256": [digest(OPERATOR_KEY)]}
    seen: list[dict[str, str]] = []
    nodes: dict[str, str] = {}  # replica -> the Ray node it ran on
    with fake_cluster() as cluster:
        wait_nodes(cluster, 1, "the worker node of min_workers")
        first = cluster.worker_nodes()
        with serving(config, tmp_path, cluster) as url:
            wait_for(url, {"s-0": UP, "s-1": ASLEEP, "s-2": ASLEEP}, seen)
            load = burst(url, seen, nodes)
            ended_s, grown = time.time(), cluster.worker_nodes()
            wait_for(url, {"s-0": UP, "s-1": ASLEEP, "s-2": ASLEEP}, seen)
            down_s = time.time() - ended_s
            wait_nodes(cluster, 1, "the idle worker nodes removed")
            kept, dead = cluster.worker_nodes(), cluster.worker_nodes(is_alive=False)
            after = Load(url, clients=1)  # the shard still serves, on the node kept
            time.sleep(2)
            after.stop()
    added = {k: v for k, v in grown.items() if k not in first}
    print(report(load, ended_s, down_s, added, {k: v for k, v in dead.items() if k in added}))
    assert set(load.statuses) == {200} and set(after.statuses) == {200}, (load.errors[:3], after.errors[:3])
    assert len(added) == 2 and set(first) < set(grown), (first, grown)
    assert nodes["s-0"] in first and {nodes["s-1"], nodes["s-2"]} == set(added), (nodes, first, grown)
    assert all(n.started_s > load.started_s for n in added.values())  # launched for the burst, not before
    assert set(kept) == set(first) and set(dead) == set(added), (kept, dead)  # the idle ones went, never s-0's
    assert all(n.death_reason == "EXPECTED_TERMINATION" for n in dead.values()), dead  # stopped by the autoscaler, not lost
    assert not any(p.get("s-0") in (DRAINING, ASLEEP) for p in seen)  # never below min_replicas
