"""`affinity`, the gateway's default policy: the same prefix under the same adapters goes to the
same replica, and finds its KV in that worker's memory, while no replica takes more than its
share of the load.

Replicas are ranked by rendezvous hashing of the request's affinity key, and the first whose
load stays within `(1 + eps)` times the mean after adding this request takes it (consistent
hashing with bounded loads), twice over: for requests in flight, so a request never queues
behind others on its favourite replica while another replica is idle (its KV is a hit in the
shared tier there; without one it would be computed again, so this bound is skipped then), and
for load, which adds the requests a replica was sent recently (a decaying count), since bounding
in-flight requests alone keeps no balance when traffic is light (everything in flight is 0 or 1,
so the hot prefix's replica gets every request it is idle for).

Where replicas have the request's adapters at different tiers (on the device, on the host, or
lower: disk or the store), the nearest replicas whose requests in flight stay in that bound come
first, the recent-load bound choosing only among them: a replica idle lately that must load the
adapter first is no faster than a busy one that has it, and a hot adapter still spills to another
replica once its replica's requests in flight pass the bound. With a shared tier, a replica with a
free slot comes before any whose slots are all taken.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policy.routing.policy import RouteRequest
from gateway.policy.routing.rendezvous import _ranks, key_bits
from gateway.policy.routing.view import ReplicaView


class AffinityPolicy:
    """Bounded-load rendezvous hashing of the affinity key; `eps`: the slack of both bounds."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def choose(self, pool: Sequence[ReplicaView], request: RouteRequest) -> ReplicaView:
        # each replica's load and rank are read once (a fleet's gateway routes over hundreds)
        n = len(pool)
        in_flight = [r.in_flight for r in pool]
        loads = [f + r.recent for f, r in zip(in_flight, pool)]
        load_bound = max(1.0, (1 + self.eps) * (sum(loads) + 1) / n)  # (1 + eps) x the mean once this request is added, >= 1
        in_flight_bound = max(1.0, (1 + self.eps) * (sum(in_flight) + 1) / n)
        ranks = _ranks(key_bits(request.key), pool)
        not_busy = ranked = sorted(range(n), key=ranks.__getitem__, reverse=True)  # indices, best rank first
        if request.shared_cache:  # never queue behind a full replica's slots while another has one free: start soonest
            ranked = [i for i in ranked if in_flight[i] < pool[i].num_seq_slots] or ranked
            not_busy = [i for i in ranked if in_flight[i] + 1 <= in_flight_bound] or [min(ranked, key=in_flight.__getitem__)]
        if request.fingerprints:
            tiers = [pool[i].tier(request.fingerprints) for i in not_busy]
            nearest = min(tiers)
            if nearest != max(tiers):  # some have the adapters nearer: one of those, while its requests in flight are in bound
                near = [i for i, tier in zip(not_busy, tiers) if tier == nearest and in_flight[i] + 1 <= in_flight_bound]
                if near:  # the recent-load bound only among them: an idle replica that must load the adapter first is no faster
                    return pool[_first_within(near, loads, load_bound)]
        return pool[_first_within(not_busy, loads, load_bound)]


def _first_within(order: Sequence[int], loads: Sequence[float], bound: float) -> int:
    """The first of `order` whose load stays within `bound` with this request, else the least loaded."""
    for i in order:
        if loads[i] + 1 <= bound:
            return i
    return min(order, key=loads.__getitem__)
