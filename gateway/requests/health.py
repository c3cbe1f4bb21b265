"""The gateway's health as /health reports it (torch-free): every shard's replicas (asked through the
`Dispatcher`), the cache's Redis, the state store as this gateway last read it, and the registry.

status: ok; degraded (a replica down, Redis down: requests run uncached, or the state store not read
lately); down (a shard has no healthy replica, or the state store's check failed: every request is
refused).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gateway.registry.registry import AdapterRegistry
from gateway.requests.dispatch import Dispatcher
from gateway.tenancy.tenants import Tenants


class Health:
    def __init__(self, dispatcher: Dispatcher, tenants: Tenants, registry: AdapterRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dispatcher, self.tenants, self.registry, self._clock = dispatcher, tenants, registry, clock

    async def full(self) -> dict[str, Any]:
        shards, redis = await self.dispatcher.replica_health()
        states = [_shard_state(s) for s in shards.values()]
        if "down" in states:
            status = "down"
        elif "degraded" in states or redis == "degraded":
            status = "degraded"
        else:
            status = "ok"
        state = self.state()
        if state["status"] == "refused":
            status = "down"
        elif state["status"] != "ok" and status == "ok":
            status = "degraded"
        return {"status": status, "redis": redis, "state": state, "shards": shards, "registry": self.registry.health()}

    def state(self) -> dict[str, Any]:
        """The state store as this gateway sees it: ok; stale (run-time keys not read within the bound:
        refused until it is read again); refused (its check failed: every request refused)."""
        tenants = self.tenants
        age_s = None if tenants.read_ok_s is None else max(0.0, self._clock() - tenants.read_ok_s)
        if tenants.refused is not None:
            status = "refused"
        elif age_s is None or age_s > tenants.stale_after_s:
            status = "stale"
        else:
            status = "ok"
        out: dict[str, Any] = {"status": status, "read_age_s": None if age_s in (None, float("inf")) else round(age_s, 3)}
        for name, why in (("refused", tenants.refused), ("went_back", tenants.went_back)):
            if why is not None:
                out[name] = why
        return out


def _shard_state(shard: dict[str, Any]) -> str:
    """ok, degraded (a replica that should serve does not) or down (none serves). An autoscaled shard's
    replicas that Serve's autoscaling keeps starting, draining or asleep are not expected to serve; a
    shard all asleep (min_replicas 0) is ok: its first request wakes it."""
    replicas = shard["replicas"]
    if not shard["healthy"]:
        return "ok" if replicas and all(r.get("phase") == "asleep" for r in replicas) else "down"
    expected = sum(r.get("phase", "up") == "up" for r in replicas)
    return "degraded" if shard["healthy"] < expected else "ok"
