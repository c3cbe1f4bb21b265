"""Autoscaled shards on a real local Ray Serve (`loraplex serve`, a tiny model): a burst of
requests scales a shard up through Serve's autoscaling with our policy (gateway/cluster/autoscaling.py),
the new replica serves, the end of the burst scales it down again, and no request fails throughout;
a shard with `min_replicas: 0` sleeps, its first request wakes it (and says how long it waited),
and it sleeps again once idle; an adapter registered then goes to a shard that serves, not to it.

Only what must hold is asserted, never a phase at an instant: the replicas' phases are polled
until they reach what is awaited, within generous bounds (a loaded 2-core machine)."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from gateway.cluster.membership import ASLEEP, DRAINING, UP
from tests.gateway.gateway_setup import ATTN, digest
from tests.tinymodels import random_lora, write_adapter
from tests.gateway.serve_process import running_serve

OPERATOR_KEY = "sk-test-autoscale-operator"
PHASE_WAIT_S = 300.0  # a replica's start on a loaded 2-core machine has taken 150 s


def phases(url: str) -> dict[str, str]:
    """Each replica's phase as /health reports it (an answering replica: up)."""
    health = httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=30).json()
    return {r["id"]: r.get("phase", UP) for shard in health["shards"].values() for r in shard["replicas"]}


def wait_for(url: str, want: dict[str, str], seen: list[dict[str, str]]) -> float:
    """Seconds until /health shows the phases `want`; every reading goes into `seen`."""
    started = time.monotonic()
    while time.monotonic() - started < PHASE_WAIT_S:
        seen.append(phases(url))
        if all(seen[-1].get(k) == v for k, v in want.items()):
            return time.monotonic() - started
        time.sleep(0.5)
    pytest.fail(f"the replicas did not reach {want} within {PHASE_WAIT_S:g} s; last seen {seen[-1]}")


def routed(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=30).text
    found = re.findall(r'loraplex_gateway_route_decisions_total\{[^}]*replica="([^"]+)"[^}]*\} ([0-9.e+]+)', text)
    return {replica: float(value) for replica, value in found}


class Load:
    """`clients` threads sending completions back to back until stopped; every answer's status is kept."""

    def __init__(self, url: str, clients: int, model: str = "tiny") -> None:
        self.model = model
        self.url, self.statuses, self.errors, self._stop = url, [], [], threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": self.model, "prompt": f"client {i} request {n}", "max_tokens": 24,
                        "temperature": 0}
                try:
                    answer = client.post(f"{self.url}/v1/completions", json=body)
                    self.statuses.append(answer.status_code)
                    if answer.status_code != 200:
                        self.errors.append(answer.text[:300])
                except httpx.HTTPError as e:
                    self.statuses.append(type(e).__name__)

    def stop(self) -> None:
        self._stop.set()
        for thread in self.threads:
            thread.join(150)


def test_a_burst_scales_a_shard_up_and_its_end_down_and_a_shard_asleep_wakes_on_its_first_request(tiny_llama, tmp_path) -> None:
    for name, seed in (("z", 5), ("y", 6), ("fresh", 7)):
        write_adapter(tmp_path / f"{name}.gguf", random_lora(tiny_llama, ATTN, 4, seed=seed))
    config = {"model": str(tiny_llama.path), "model_name": "tiny",
              "adapters": [{"name": "z", "path": "z.gguf"}, {"name": "y", "path": "y.gguf"}],
              "shards": [{"name": "s", "adapters": ["y"], "autoscaling": {
                  "min_replicas": 1, "max_replicas": 2, "target_utilization": 0.5, "upscale_delay_s": 1.0,
                  "downscale_delay_s": 4.0, "lead_s": 0.0}},
                  {"name": "a", "adapters": ["z"], "autoscaling": {"min_replicas": 0, "max_replicas": 1, "idle_s": 5.0}}],
              "registry": {"copies": 1, "store_dir": str(tmp_path / "store")},
              "engine": {"num_seq_slots": 4}, "cache": {"redis_url": None}, "state": {"ephemeral": True}, "auth": "none",
              "operator_key_sha256": [digest(OPERATOR_KEY)]}
    seen: list[dict[str, str]] = []
    with running_serve(config, tmp_path) as url:
        wait_for(url, {"s-0": UP, "s-1": ASLEEP, "a-0": ASLEEP}, seen)  # min_replicas: one, and none for a
        load = Load(url, clients=4)
        try:
            up_s = wait_for(url, {"s-0": UP, "s-1": UP}, seen)
            deadline = time.monotonic() + 60
            while routed(url).get("s-1", 0) < 3 and time.monotonic() < deadline:  # the new replica takes requests
                time.sleep(0.5)
        finally:
            load.stop()
        assert routed(url).get("s-1", 0) >= 3, routed(url)
        down_s = wait_for(url, {"s-0": UP, "s-1": ASLEEP}, seen)
        after = Load(url, clients=1)  # the shard still serves on its one replica
        time.sleep(2)
        after.stop()

        woken = httpx.post(f"{url}/v1/completions", timeout=200,
                           json={"model": "z", "prompt": "wake up", "max_tokens": 4, "temperature": 0})
        assert woken.status_code == 200, woken.text
        assert woken.headers["x-loraplex-replica"] == "a-0" and int(woken.headers["x-loraplex-cold-start-ms"]) > 0
        assert woken.json()["timings"]["prompt_ms"] >= int(woken.headers["x-loraplex-cold-start-ms"])  # its wait is in its timings
        again = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "z", "prompt": "still up", "max_tokens": 4})
        assert again.status_code == 200 and "x-loraplex-cold-start-ms" not in again.headers
        asleep_s = wait_for(url, {"a-0": ASLEEP}, seen)  # idle_s without a request: it sleeps again
        # a and s pin one adapter each, a first by name, but a sleeps: a new adapter goes where a replica serves
        with open(tmp_path / "fresh.gguf", "rb") as f:
            added = httpx.post(f"{url}/v1/adapters", headers={"Authorization": f"Bearer {OPERATOR_KEY}"}, timeout=120,
                               data={"name": "fresh"}, files={"file": ("fresh.gguf", f, "application/octet-stream")})
        assert added.status_code in (200, 201), added.text
        served = httpx.post(f"{url}/v1/completions", timeout=60, json={"model": "fresh", "prompt": "new", "max_tokens": 4})
        assert served.status_code == 200 and served.headers["x-loraplex-replica"].startswith("s-"), served.text
        assert phases(url)["a-0"] == ASLEEP  # nothing woke it
    print(f"scaled up {up_s:.1f} s after the burst began; down {down_s:.1f} s after it ended; "
          f"{len(load.statuses)} requests during the burst, {len(after.statuses)} after; a cold start waited "
          f"{woken.headers['x-loraplex-cold-start-ms']} ms; asleep again {asleep_s:.1f} s after")
    assert load.statuses and after.statuses
    assert set(load.statuses) == {200} and set(after.statuses) == {200}, (load.errors[:3], after.errors[:3])
    assert not any(p.get("s-0") in (DRAINING, ASLEEP) for p in seen)  # never below min_replicas
