"""loraplex on several machines (issue 38): three Ray nodes on this machine, each with its own
address, HOME and temp dirs (network namespaces: bench/cluster/netns.py), a 6-process Redis
Cluster, an S3-compatible server, and `loraplex serve` joining the Ray cluster as an operator's
would. The gateway runs on the head; the shard's two replicas on the two worker hosts, which
share no directory with the head or each other.

- an adapter uploaded through the gateway is served by replicas on the two other nodes;
- a node cut off for a while, then restored, and a node's processes SIGKILLed, each under steady
  mixed load (streamed and whole, two tenants): no whole request lost, every stream ends (done,
  or the clean error event), nothing past its deadline, no request left behind on a replica, the
  registry's adapters listed and served;
- a Redis master SIGKILLed under the same load: no failed request, the adapter uploaded just
  before still listed and served, prefix-cache hits (from Redis: the workers keep no prefix in
  memory here) back within CACHE_RESUME_BOUND_S, each the tokens its miss gave.
The figures each fault cost are printed (pytest -s shows them).
"""

from __future__ import annotations

import hashlib
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.cluster import free_port, netns
from bench.cluster.ray_nodes import RayNodes
from bench.cluster.redis_cluster import LocalRedisCluster
from bench.cluster.topology import Topology
from bench.server import ServeFailed, Server
from tests.tinymodels import random_lora, write_adapter

KEYS = {"t1": "sk-multi-one", "t2": "sk-multi-two", "operator": "sk-multi-operator"}
ATTN = ["blk.0.attn_q.weight", "blk.1.attn_v.weight"]
PROMPT = list(range(40, 120))  # > 2 cache chunks of 32
REQUEST_TIMEOUT_S = 30  # the server's deadline for every request: nothing may wait past it
CACHE_RESUME_BOUND_S = 30  # after a Redis master's failover, prefix-cache hits come back within this
INGRESS_LABEL = "loraplex.io/ingress"


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Cluster:
    topology: Topology
    serving: Server

    @property
    def network(self) -> netns.Network:
        return self.topology.network

    @property
    def ray(self) -> RayNodes:
        return self.topology.ray

    @property
    def redis(self) -> LocalRedisCluster:
        return self.topology.redis

    @property
    def hosts(self) -> list[netns.Host]:
        return self.topology.hosts

    @property
    def url(self) -> str:
        return self.serving.url


@pytest.fixture(scope="module")
def cluster(tiny_llama) -> Iterator[Cluster]:
    missing = netns.available()
    assert missing is None, missing  # CI runs as root: this feature's only test must run, never skip
    topology = Topology(head_cpus=1, head_labels=f"{INGRESS_LABEL}=yes")
    try:
        for label in ("n1", "n2"):
            topology.add_worker(label, num_cpus=2)
        config = topology.config(
            str(tiny_llama.path), "tiny",
            shards=[{"name": "s", "adapters": [], "replicas": 2, "num_cpus": 1}],
            tenants=[{"id": t, "key_sha256": [digest(KEYS[t])], "max_adapters": 4} for t in ("t1", "t2")],
            operator_key_sha256=[digest(KEYS["operator"])],
            engine={"num_seq_slots": 4, "max_step_tokens": 256},
            http={"host": "0.0.0.0", "port": free_port(), "request_timeout_s": REQUEST_TIMEOUT_S,
                  "node_labels": {INGRESS_LABEL: "yes"}},  # the head takes the traffic
        )
        config["cache"]["l1_bytes"] = 0  # no prefix kept in a worker's memory: every hit comes from Redis
        try:
            with topology.serving(config) as serving:
                yield Cluster(topology, serving)
        except ServeFailed as e:
            pytest.fail(str(e))
    finally:
        topology.close()


def auth(who: str = "t1") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[who]}"}


def replica_nodes(c: Cluster) -> dict[str, str]:
    """replica id -> the address of the node it runs on (operator /health)."""
    health = httpx.get(f"{c.url}/health", headers=auth("operator"), timeout=10).json()
    return {r["id"]: (r.get("node") or {}).get("ip", "") for s in health["shards"].values() for r in s["replicas"] if r["healthy"]}


def nothing_left(c: Cluster) -> bool:
    """Every replica idle, by the gateway's count and by its engine's."""
    health = httpx.get(f"{c.url}/health", headers=auth("operator"), timeout=10).json()
    replicas = [r for s in health["shards"].values() for r in s["replicas"]]
    return all(r["healthy"] and r["in_flight"] == 0 and r["requests"] == {"running": 0, "waiting": 0} for r in replicas)


def upload(c: Cluster, name: str, path: Path, tenant: str = "t1") -> httpx.Response:
    with path.open("rb") as f:
        return httpx.post(f"{c.url}/v1/adapters", headers=auth(tenant), data={"name": name},
                          files={"file": (path.name, f, "application/octet-stream")}, timeout=120)


def complete(c: Cluster, model: str, tenant: str = "t1", stream: bool = False, max_tokens: int = 8,
             prompt: list[int] = PROMPT) -> tuple[int, dict, list]:
    """(status, headers, events or the body) of one /v1/completions request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if not stream:
        r = httpx.post(f"{c.url}/v1/completions", headers=auth(tenant), json=body, timeout=REQUEST_TIMEOUT_S + 30)
        return r.status_code, dict(r.headers), [r.json()]
    events = []
    with httpx.stream("POST", f"{c.url}/v1/completions", headers=auth(tenant), json=body, timeout=REQUEST_TIMEOUT_S + 30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
        return r.status_code, dict(r.headers), events


class Load:
    """Steady mixed load until stopped: whole and streamed, two tenants, t1 on the adapter and the
    base (`models`, the base last), t2 on the base."""

    def __init__(self, c: Cluster, models: list[str], num_threads: int = 4) -> None:
        self.c, self.models = c, models
        self.whole: list[tuple[float, int]] = []  # (when it ended, status)
        self.streams: list[tuple[float, str]] = []  # (when it ended, "done" | "error" | "cut": ended without either)
        self.errors: list[tuple[float, str]] = []  # (when, the body) of whole requests that failed
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_threads)]

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            stream, tenant = (i + n) % 2 == 1, ("t1", "t2")[(n // 2) % 2]
            model = self.models[(n // 4) % len(self.models)] if tenant == "t1" else self.models[-1]  # t2 sees the base only
            n += 1
            try:
                status, _, events = complete(self.c, model, tenant, stream=stream)
            except httpx.HTTPError as e:
                (self.streams if stream else self.whole).append((time.monotonic(), f"transport: {e!r}" if stream else -1))
                continue
            if not stream:
                self.whole.append((time.monotonic(), status))
                if status != 200:
                    self.errors.append((time.monotonic(), str(events[0])[:300]))
            elif status != 200:
                self.streams.append((time.monotonic(), f"status {status}"))
            else:
                last = events[-1] if events else ""
                ok = last == "[DONE]" and not any('"error"' in e for e in events)
                self.streams.append((time.monotonic(), "done" if ok else ("error" if any('"error"' in e for e in events) else "cut")))

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(REQUEST_TIMEOUT_S + 60)
        assert not any(t.is_alive() for t in self._threads), "a request outlived its deadline"


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds until `predicate()` held (fails past `timeout_s`)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.5)
    return time.monotonic() - started


@pytest.fixture(scope="module")
def adapter(cluster, tiny_llama, tmp_path_factory) -> str:
    path = write_adapter(tmp_path_factory.mktemp("multi") / "bot.gguf", random_lora(tiny_llama, ATTN, 4, seed=11))
    r = upload(cluster, "bot", path)
    assert r.status_code in (200, 201), r.text
    return "bot"


def test_an_adapter_uploaded_on_one_node_is_served_by_replicas_on_the_others(cluster, adapter) -> None:
    nodes = replica_nodes(cluster)
    workers = {h.address for h in cluster.hosts}
    assert set(nodes.values()) == workers, nodes  # one replica on each worker node, none on the head
    served_by = set()
    for _ in range(20):
        status, headers, body = complete(cluster, adapter)
        assert status == 200, body
        served_by.add(headers["x-loraplex-replica"])
        if served_by == set(nodes):
            break
    assert served_by == set(nodes)
    caches = [h.home / ".cache" / "loraplex" / "adapters" for h in cluster.hosts]
    caches.append(cluster.ray.head_dir / ".cache" / "loraplex" / "adapters")
    held = [sorted(p.name for p in d.rglob("*") if p.is_file()) if d.exists() else [] for d in caches]
    assert all(held[:2]), f"each worker node fetched the adapter into its own cache: {held}"
    assert len({str(d) for d in caches}) == 3  # three directories, none shared


def test_a_node_cut_off_then_restored_under_load(cluster, adapter) -> None:
    victim = cluster.hosts[1]
    with Load(cluster, [adapter, "tiny"]) as load:
        time.sleep(3)
        cut_at = time.monotonic()
        cluster.network.cut(victim)
        time.sleep(20)
        cluster.network.restore(victim)
        time.sleep(5)
    report("cut 20 s", load, cut_at, cluster)
    assert_no_loss(load)
    wait_until(lambda: len(replica_nodes(cluster)) == 2, 120, "the shard has two healthy replicas again")
    wait_until(lambda: nothing_left(cluster), REQUEST_TIMEOUT_S, "no request left on a replica or in the gateway")  # none stuck


def test_a_node_lost_under_load(cluster, adapter) -> None:
    victim = cluster.hosts[0]
    print(f"node SIGKILLed: replicas before, by node: {replica_nodes(cluster)}; the victim: {victim.address}")
    with Load(cluster, [adapter, "tiny"]) as load:
        time.sleep(3)
        killed_at = time.monotonic()
        assert cluster.network.kill(victim) > 0
        served_again = wait_until(lambda: len(replica_nodes(cluster)) == 2, 120, "the shard has two healthy replicas again")
        time.sleep(3)
    report("node SIGKILLed", load, killed_at, cluster)
    print(f"node SIGKILLed (at {killed_at:.1f}): the shard had two healthy replicas again {served_again:.1f} s later")
    assert_no_loss(load)
    assert adapter in [m["id"] for m in httpx.get(f"{cluster.url}/v1/models", headers=auth(), timeout=10).json()["data"]]
    assert complete(cluster, adapter)[0] == 200


def test_a_redis_master_lost_under_load(cluster, adapter, tiny_llama, tmp_path) -> None:
    path = write_adapter(tmp_path / "late.gguf", random_lora(tiny_llama, ATTN, 4, seed=12))
    with Load(cluster, [adapter, "tiny"]) as load:
        assert upload(cluster, "late", path, tenant="t2").status_code in (200, 201)
        key = registry_key(cluster.redis)
        old = cluster.redis.master_of(key)
        killed_at = time.monotonic()
        cluster.redis.kill(old)
        cluster.redis.wait_for_new_master(key, old, 30)
        print(f"Redis master SIGKILLed: a replica took over {time.monotonic() - killed_at:.1f} s later")
        hits, resumed_s = cache_hits_resume(cluster, adapter)
        print(f"Redis master SIGKILLed: prefix-cache hits again {resumed_s - killed_at:.1f} s after the kill "
              f"({hits} prompts, each hit the same tokens as its miss)")
        time.sleep(3)
    report("Redis master SIGKILLed", load, killed_at, cluster)
    assert all(status == 200 for _, status in load.whole), load.whole
    assert all(outcome == "done" for _, outcome in load.streams), load.streams
    listed = [m["id"] for m in httpx.get(f"{cluster.url}/v1/models", headers=auth("t2"), timeout=10).json()["data"]]
    assert "late" in listed
    assert complete(cluster, "late", tenant="t2")[0] == 200


def cache_hits_resume(c: Cluster, adapter: str) -> tuple[int, float]:
    """New prompts, each asked twice (the first computes and stores it, the second should find it in
    Redis: the module's workers keep no prefix in memory), until one is found: (prompts asked, when
    the first was found). Every answer from the cache is the tokens the computed one gave."""
    rng = random.Random(7)
    deadline = time.monotonic() + CACHE_RESUME_BOUND_S
    for asked in range(1, 1000):
        prompt = rng.sample(PROMPT, len(PROMPT))
        first = complete(c, adapter, tenant="t1", prompt=prompt)
        assert first[0] == 200 and first[2][0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first  # a miss
        for _ in range(5):  # its chunks are written behind the answer
            again = complete(c, adapter, tenant="t1", prompt=prompt)
            assert again[0] == 200, again
            assert again[2][0]["choices"][0]["text"] == first[2][0]["choices"][0]["text"]  # a hit gives what a miss gave
            if again[2][0]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0:
                return asked, time.monotonic()
            time.sleep(0.2)
        if time.monotonic() > deadline:
            pytest.fail(f"no prefix-cache hit within {CACHE_RESUME_BOUND_S} s of the failover")
    raise AssertionError("unreachable")


def registry_key(redis_cluster: LocalRedisCluster) -> str:
    """The registry's records key (its hash tag puts every registry key on one master)."""
    for port in redis_cluster.masters():
        found = redis_cluster.nodes[port].ask("KEYS", "*registry}:records")
        if found:
            return found[0].decode()
    raise AssertionError("no registry records in the Redis Cluster")


def assert_no_loss(load: Load) -> None:
    assert load.whole and load.streams
    failed = [(t, s) for t, s in load.whole if s != 200]
    assert not failed, f"whole requests that failed: {failed}: {load.errors[:3]}"
    assert all(outcome in ("done", "error") for _, outcome in load.streams), load.streams  # none cut off without its error event


def report(what: str, load: Load, at: float, c: Cluster) -> None:
    after = [s for t, s in load.streams if t >= at]
    silent = c.topology.gateway_log().count("sent nothing for")  # the gateway gave up on a silent replica's channel
    print(f"{what}: {len(load.whole)} whole requests, {sum(s != 200 for _, s in load.whole)} failed; "
          f"{len(load.streams)} streams, {sum(o == 'error' for _, o in load.streams)} ended with the error event "
          f"({len(after)} after the fault); silent channels given up on so far: {silent}")
    sys.stdout.flush()
