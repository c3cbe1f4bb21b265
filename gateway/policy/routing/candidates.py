"""The replicas that may take a request, and the errors that say why none may.

Candidates are the healthy replicas whose shard holds every adapter the request enables (when
every reachable one failed a request lately, those: a cool-down is a preference, not a ban). A
replica whose slots and queue are full is no candidate (`ReplicasBusy` when none is left: the
gateway answers 503 with Retry-After).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from gateway.policy.routing.view import ReplicaView
from worker.contract.identity import AdapterName, Fingerprint


class NoCandidateError(LookupError):
    """No healthy replica holds every adapter the request needs."""


class NoneReachable(NoCandidateError):
    """Replicas hold the adapters and were not tried yet, but none is reachable now."""


class ReplicasBusy(NoCandidateError):
    """Replicas hold the adapters, but every one of them is full (its slots and queue)."""


def candidates(replicas: Sequence[ReplicaView], fingerprints: Collection[Fingerprint], exclude: Collection[str] = (),
               names: Mapping[Fingerprint, AdapterName] | None = None) -> list[ReplicaView]:
    """The replicas that may take a request for `fingerprints`, not in `exclude` (replica ids);
    `names` (the tenant's, by fingerprint) name the adapters in errors."""
    needed = frozenset(fingerprints)
    shown = ", ".join(sorted((names or {}).get(fp, fp) for fp in needed)) or "(base model)"
    holding = [r for r in replicas if needed <= r.fingerprints]
    if not holding:
        raise NoCandidateError(f"no shard holds all of the adapters {shown} together")
    untried = [r for r in holding if r.replica_id not in exclude] if exclude else holding
    reachable = [r for r in untried if r.is_reachable]
    healthy = [r for r in reachable if r.is_healthy] or reachable  # each failed lately, yet answers: try again rather than refuse
    if not healthy:
        error = NoneReachable if untried else NoCandidateError
        raise error(f"no healthy replica for adapters {shown}: all {len(holding)} are down or failed")
    room = [r for r in healthy if r.in_flight < r.capacity]
    if not room:
        raise ReplicasBusy(f"every replica for adapters {shown} is full: try again shortly")
    return room
