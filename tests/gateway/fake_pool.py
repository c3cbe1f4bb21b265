"""A shard pool with no model and no torch: each replica answers a call with one token per
`max_tokens` (the prompt's tokens, in turn), scripted to die, die mid-stream or refuse.
For gateway tests of routing, failover and refusals (as Ray Serve's router tests use a
fake replica)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gateway.cluster.pool import WorkerFailed, replica_infos
from gateway.config import ServeConfig
from worker.contract.calls import Delta, Usage, WorkerCall


class FakePool:
    def __init__(self, config: ServeConfig) -> None:
        self.replicas = replica_infos(config)
        self.calls: list[tuple[str, WorkerCall]] = []  # (replica, call), in order
        self.killed: set[str] = set()  # fail at once, and in health checks
        self.fail_after: dict[str, int] = {}  # die after this many deltas (once)
        self.refusal: str | None = None  # every replica refuses every call with this message
        self.unreachable: set[str] = set()  # known gone, as a silent channel shows one (gateway/cluster/channel.py)

    async def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        self.calls.append((replica_id, call))
        if replica_id in self.killed:
            raise WorkerFailed(f"replica {replica_id} is dead")
        if self.refusal is not None:
            yield Delta.refused(self.refusal)
            return
        n = max(call.params.max_tokens, 1)
        for i in range(n):
            if self.fail_after.get(replica_id) == i:
                del self.fail_after[replica_id]
                raise WorkerFailed(f"replica {replica_id} died")
            token = call.prompt_ids[i % len(call.prompt_ids)]
            last = i == n - 1
            yield Delta((token,), f"<{token}>", finish_reason="length" if last else None,
                        usage=Usage(len(call.prompt_ids), n, 0) if last else None)

    def is_reachable(self, replica_id: str) -> bool:
        return replica_id not in self.unreachable

    async def health(self, replica_id: str) -> dict[str, Any]:
        if replica_id in self.killed:
            raise ConnectionError(f"replica {replica_id} is dead")
        return {"cache": {"redis": "off"}}

    async def metrics(self, replica_id: str) -> str:
        return ""
