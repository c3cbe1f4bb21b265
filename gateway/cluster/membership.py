"""Which replicas of the autoscaled shards serve now, as Ray Serve reports them (torch-free, Ray-free:
the status is read through a callable). A shard with `autoscaling` has one Serve deployment per
replica it may have (gateway/serve.py), each of zero or one Serve replica as the shard's policy
decides (gateway/cluster/autoscaling.py). The gateway routes only to a replica that is up, lets one
that goes drain, and never calls one that is asleep or starting: a call to a deployment without a
running replica waits at Serve's router, and one to a deployment scaled to zero wakes it.

A replica's phase:
- up: it runs and is not being scaled down; it has taken its pins from the registry;
- starting: asked for, not serving yet (its model and adapters being fetched, or its pins pushed);
- draining: being scaled down: it takes no new request, and once its requests are done its
  channel closes, so that Serve stops it at once instead of waiting out its timeout;
- asleep: none runs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often the gateway reads the replicas' states from Serve
UP, STARTING, DRAINING, ASLEEP = "up", "starting", "draining", "asleep"

# a deployment's status and its replicas counted by state (Serve's names), by replica id
Status = Mapping[str, tuple[str, Mapping[str, int]]]


def phase_of(status: str, replica_states: Mapping[str, int]) -> str:
    """The phase of a replica's deployment from Serve's status of it (DOWNSCALING, HEALTHY, ...) and
    its replicas by state (RUNNING, STARTING, STOPPING, ...)."""
    if status == "DOWNSCALING":
        return DRAINING
    if replica_states.get("RUNNING", 0):
        return UP
    if any(replica_states.values()):
        return STARTING  # STARTING, PENDING_MIGRATION, RECOVERING, or one stopped to be replaced
    return ASLEEP


class Membership:
    """The phases of `replica_ids`, read every POLL_S by `run`. A replica Serve says runs becomes
    up only once `joined(replica_id)` has returned (the registry gave it its pins); `leaving(replica_id)`
    is called when one starts to drain or is gone."""

    def __init__(self, replica_ids: Iterable[str], read: Callable[[], Status],
                 joined: Callable[[str], Awaitable[None]] | None = None,
                 leaving: Callable[[str], None] | None = None) -> None:
        self._read = read
        self.joined, self.leaving = joined, leaving
        self.phases = dict.fromkeys(replica_ids, STARTING)  # nothing is called before Serve's first word
        self.serving = dict.fromkeys(self.phases, False)  # Serve runs it (it may take its pins)
        self.num_reads = 0

    def phase(self, replica_id: str) -> str:
        return self.phases.get(replica_id, UP)

    async def run(self) -> None:
        while True:
            try:
                await self.update(await asyncio.to_thread(self._read))
            except Exception as e:  # noqa: BLE001 - Serve's controller unreachable for a moment: the last phases hold
                log.warning("the replicas' states could not be read (%s: %s)", type(e).__name__, e)
            await asyncio.sleep(POLL_S)

    async def update(self, status: Status) -> None:
        """Take one reading of Serve's status; a replica that comes up joins before it is routed to."""
        self.num_reads += 1
        for replica_id, old in list(self.phases.items()):
            if replica_id not in status:
                continue
            new = phase_of(*status[replica_id])
            self.serving[replica_id] = new == UP
            if new == old:
                continue
            if new == UP:
                try:
                    if self.joined is not None:
                        await self.joined(replica_id)
                except Exception as e:  # noqa: BLE001 - it stays starting; the next reading tries again
                    log.warning("replica %s did not join (%s: %s)", replica_id, type(e).__name__, e)
                    continue
            elif old == UP and self.leaving is not None:
                self.leaving(replica_id)
            log.info("replica %s: %s -> %s", replica_id, old, new)
            self.phases[replica_id] = new
