"""The gateway's view of the workers: replicas, the pool interface the gateway calls them
through, and how a replica failing shows (torch-free).

A shard pool is anything with `replicas` and `stream(replica_id, call)` (an async
iterator of the worker's `Delta`s): Ray Serve handles in production
(gateway/serve.py), a fake or in-process workers in tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config import ServeConfig
from worker.contract.calls import Delta, WorkerCall
from worker.contract.identity import Fingerprint


@dataclass(frozen=True)
class ReplicaInfo:
    """Which replica, of which shard (what it holds is the registry's to know)."""

    replica_id: str
    shard: str
    index: int = 0  # which of its shard's replicas (an autoscaled shard scales down the highest first)


def replica_infos(config: ServeConfig) -> list[ReplicaInfo]:
    """Every replica of every shard (an autoscaled one: as many as it may have), named `<shard>-<i>` (the
    Serve deployment is `shard-<shard>-<i>`)."""
    return [ReplicaInfo(f"{s.name}-{i}", s.name, i) for s in config.shards for i in range(s.replicas)]


class NotServing(ConnectionError):
    """A replica of an autoscaled shard that does not serve now (starting, draining or asleep): it is not called."""


class WorkerFailed(RuntimeError):
    """The replica died or could not be reached (as opposed to a request it refused)."""


class ShardPool(Protocol):
    replicas: list[ReplicaInfo]

    def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        """The worker's deltas; WorkerFailed when the replica cannot be reached or dies."""

    async def health(self, replica_id: str) -> dict[str, Any]: ...

    async def sync(self, replica_id: str, version: int, pins: dict[Fingerprint, str]) -> dict[str, Any]:
        """Make the replica hold exactly `pins` (fingerprint -> adapter file); what it holds now
        (worker/residency/). A pool without it: its workers keep the config's adapters."""

    async def metrics(self, replica_id: str) -> str: ...

    def is_reachable(self, replica_id: str) -> bool:
        """False while the replica is known gone (gateway/cluster/channel.py: Channels). A pool without
        it: every replica is, until a request to it fails."""
