"""Which replica serves a request: pure policies over a snapshot of the replicas, with the clock
and the RNG passed in. Adapters are known here by fingerprint only.

The gateway routes in two steps: `candidates` (candidates.py) keeps the replicas that may take the
request, and a policy picks one of them (`choose`, by the config's `routing.policy`). The modules,
lowest first:

    view        ReplicaView: a replica at one moment; Residents: where a worker with tiers has its adapters
    recent      RecentLoad: requests routed to each replica lately, decaying
    candidates  candidates, and NoCandidateError, NoneReachable, ReplicasBusy when there are none
    policy      RoutingPolicy: the interface every policy implements; RouteRequest: what it knows of the request
    rendezvous  affinity_key, and each replica's rank for a key
    affinity    AffinityPolicy (`affinity`, the default): bounded-load rendezvous hashing
    baselines   RandomPolicy (`random`), LeastLoadedPolicy (`least_loaded`): there to compare against
    registry    POLICIES (the one list of the policies a config may name), RoutingSettings, choose

The fleet simulator (bench/sim/routers.py) routes with `candidates` and `choose` themselves, and
its comparison routers implement RoutingPolicy too.
"""

from gateway.policy.routing.affinity import AffinityPolicy
from gateway.policy.routing.baselines import LeastLoadedPolicy, RandomPolicy
from gateway.policy.routing.candidates import NoCandidateError, NoneReachable, ReplicasBusy, candidates
from gateway.policy.routing.policy import RouteRequest, RoutingPolicy
from gateway.policy.routing.recent import RecentLoad
from gateway.policy.routing.registry import POLICIES, RoutingSettings, choose
from gateway.policy.routing.rendezvous import affinity_key
from gateway.policy.routing.view import DEVICE, HOST, LOWER, ReplicaView, Residents

__all__ = [
    "DEVICE", "HOST", "LOWER", "POLICIES", "AffinityPolicy", "LeastLoadedPolicy", "NoCandidateError", "NoneReachable",
    "RandomPolicy", "RecentLoad", "ReplicaView", "ReplicasBusy", "Residents", "RouteRequest", "RoutingPolicy",
    "RoutingSettings", "affinity_key", "candidates", "choose",
]
