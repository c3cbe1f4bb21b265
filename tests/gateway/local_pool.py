"""Every replica of every shard as an in-process ShardWorker (torch), reached through the
gateway's channel as production reaches a replica over Ray (gateway/cluster/channel.py): the gateway
end to end without Ray. A replica in `killed` fails like a dead one (and is unreachable, as its
silent channel would show); one in `fail_after` dies after that many deltas of its next request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from gateway.cluster.channel import ReplicaChannel
from gateway.cluster.pool import WorkerFailed, replica_infos
from gateway.config import ServeConfig
from tests.helpers import channel_to
from worker.contract.calls import Delta, WorkerCall
from worker.shard import ShardWorker


class LocalShardPool:
    def __init__(self, config: ServeConfig, device: str = "cpu") -> None:
        self.replicas = replica_infos(config)
        specs = {s.name: config.worker_spec(s.name, device=device) for s in config.shards}
        self.workers = {r.replica_id: ShardWorker(specs[r.shard]) for r in self.replicas}
        self.killed: set[str] = set()
        self.fail_after: dict[str, int] = {}
        self._channels: dict[str, tuple[asyncio.AbstractEventLoop, ReplicaChannel]] = {}

    def _channel(self, replica_id: str) -> ReplicaChannel:
        """The replica's channel on this event loop (tests run several loops), opened on first use."""
        loop = asyncio.get_running_loop()
        opened = self._channels.get(replica_id)
        if opened is None or opened[0] is not loop or opened[1].failure is not None:
            opened = self._channels[replica_id] = (loop, channel_to(self.workers[replica_id]))
        return opened[1]

    async def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        if replica_id in self.killed:
            raise WorkerFailed(f"replica {replica_id} is dead")
        sent = 0
        async with aclosing(self._channel(replica_id).stream(call)) as deltas:  # a replica that dies stops its request
            async for delta in deltas:
                if replica_id in self.killed or self.fail_after.get(replica_id) == sent:
                    raise WorkerFailed(f"replica {replica_id} died")
                sent += 1
                yield delta

    def is_reachable(self, replica_id: str) -> bool:  # a dead replica's channel goes silent (gateway/cluster/channel.py)
        return replica_id not in self.killed

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
