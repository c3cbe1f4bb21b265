"""The interface every routing policy implements (the gateway's, and the fleet simulator's
comparison routers): given the candidates and the request's facts, the replica to send it to."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.policy.routing.view import ReplicaView
from worker.contract.identity import Fingerprint


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy knows of the request it routes."""

    key: bytes  # what its prompt starts with, under its adapters (the gateway's: rendezvous.affinity_key)
    fingerprints: Collection[Fingerprint] = ()  # the adapters it enables
    # any replica can fetch its prompt's cached prefix (a shared cache tier): one that was not sent
    # this prefix before computes nothing again
    shared_cache: bool = True


class RoutingPolicy(Protocol):
    """Picks the replica of `pool` that takes `request`. `pool` is a snapshot, non-empty (the
    candidates: `candidates.candidates`), in the caller's order; a policy reads it and its own
    state (a cursor, where it sent what), never I/O or the clock; what it draws at random comes
    from the RNG it was built with."""

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView: ...
