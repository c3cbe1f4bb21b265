"""Every replica of every shard as an in-process ShardWorker (torch): the gateway end to end
without Ray. A replica in `killed` fails like a dead one; one in `fail_after` dies after
that many deltas of its next request."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from gateway.config import ServeConfig
from gateway.pool import WorkerFailed, replica_infos
from worker.contract.calls import Delta, WorkerCall
from worker.shard import ShardWorker


class LocalShardPool:
    def __init__(self, config: ServeConfig, device: str = "cpu") -> None:
        self.replicas = replica_infos(config)
        specs = {s.name: config.worker_spec(s.name, device=device) for s in config.shards}
        self.workers = {r.replica_id: ShardWorker(specs[r.shard]) for r in self.replicas}
        self.killed: set[str] = set()
        self.fail_after: dict[str, int] = {}

    async def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        if replica_id in self.killed:
            raise WorkerFailed(f"replica {replica_id} is dead")
        sent = 0
        async with aclosing(self.workers[replica_id].generate(call)) as deltas:  # a replica that dies stops its request
            async for delta in deltas:
                if replica_id in self.killed or self.fail_after.get(replica_id) == sent:
                    raise WorkerFailed(f"replica {replica_id} died")
                sent += 1
                yield delta

    async def health(self, replica_id: str) -> dict[str, Any]:
        if replica_id in self.killed:
            raise ConnectionError(f"replica {replica_id} is dead")
        return self.workers[replica_id].health()

    async def sync(self, replica_id: str, version: int, pins: dict[str, str]) -> dict[str, Any]:
        if replica_id in self.killed:
            raise ConnectionError(f"replica {replica_id} is dead")
        return await self.workers[replica_id].sync(version, pins)

    async def metrics(self, replica_id: str) -> str:
        return self.workers[replica_id].metrics()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
