"""Which replica serves a request (SPEC §7): pure functions over a snapshot.

Adapters are known here by fingerprint only. Candidates are the healthy replicas whose
shard holds every adapter the request enables (when every reachable one failed a request
lately, those: a cool-down is a preference, not a ban). Among them, `affinity` ranks replicas by
rendezvous hashing of the request's affinity key (adapter-set fingerprint + first prefix
chunk), so the same prefix under the same adapters goes to the same replica and finds its
KV in that worker's memory, and takes the first whose load stays within `(1 + eps)` times
the mean after adding this request (consistent hashing with bounded loads), twice over:
for requests in flight, so a request never queues behind others on its favourite replica
while another replica is idle (its KV is an L2 hit there; without a shared cache tier it
would be computed again, so this bound is skipped then), and for load, which adds the
requests a replica was sent recently (a decaying count), since bounding in-flight
requests alone keeps no balance when traffic is light (everything in flight is 0 or 1,
so the hot prefix's replica gets every request it is idle for).
Where replicas have the request's adapters at different tiers (on the device, on the host, or
lower: disk or the store; workers with tiers report where, and a replica a request was just
sent to has them on its device), the nearest replicas whose requests in flight stay in that
bound come first, the recent-load bound choosing only among them: a replica idle lately that
must load the adapter first is no faster than a busy one that has it, and a hot adapter still
spills to another replica once its replica's requests in flight pass the bound.
A replica whose slots and queue are full is no candidate (`ReplicasBusy` when none is
left: the gateway answers 503 with Retry-After); with a shared tier, a replica with a
free slot comes before any whose slots are all taken.
`random` and `least_loaded` (in flight) are there to compare against.
"""

from __future__ import annotations

import hashlib
import random as random_module
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any
from dataclasses import dataclass

import numpy as np

from worker.contract.calls import CHANNEL_HEARTBEAT_S
from worker.contract.identity import AdapterName, Fingerprint

POLICIES = ("affinity", "random", "least_loaded")
DEVICE, HOST, LOWER = 0, 1, 2  # where a replica has an adapter (worker/engine/residency.py; disk and the store: LOWER)


@dataclass(frozen=True)
class RoutingSettings:
    """How the gateway routes and fails over (the deployment config's `routing`; every default here, once)."""

    policy: str = "affinity"  # one of POLICIES
    eps: float = 0.25  # bounded load: a replica takes a request while its load stays within (1 + eps) x the mean
    half_life_s: float = 30.0  # of the recent-load count (RecentLoad)
    max_attempts: int = 2  # replicas a request may be tried on: one failover, so one poison request cannot take down them all
    failed_cooldown_s: float = 5.0  # a replica that failed gets no request for this long
    worker_grace_s: float = 5.0  # past the worker's own deadline, the gateway stops waiting for it
    health_timeout_s: float = 2.0  # a replica's answer to health and metrics
    busy_retry_after_s: int = 1  # Retry-After of a 503 when every replica is busy
    # a replica's channel silent this long (it sends a heartbeat each CHANNEL_HEARTBEAT_S) fails: its
    # requests go elsewhere, and it gets none until it is heard from again (gateway/channel.py)
    unresponsive_after_s: float = 10.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r} (known: {', '.join(POLICIES)})")
        if not self.eps > 0 or not self.half_life_s > 0:
            raise ValueError(f"eps and half_life_s must be > 0, got {self.eps} and {self.half_life_s}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if min(self.failed_cooldown_s, self.worker_grace_s, self.busy_retry_after_s) < 0 or not self.health_timeout_s > 0:
            raise ValueError("failed_cooldown_s, worker_grace_s and busy_retry_after_s must be >= 0, health_timeout_s > 0")
        if not self.unresponsive_after_s >= 2 * CHANNEL_HEARTBEAT_S:
            raise ValueError(f"unresponsive_after_s must be at least twice the replicas' heartbeat ({CHANNEL_HEARTBEAT_S:g} s), "
                             f"got {self.unresponsive_after_s}")


@dataclass(slots=True)
class ReplicaView:
    """One replica as routing sees it, at one moment. Not frozen, though nothing changes one once
    built: a gateway builds one per replica per request, and a frozen one takes three times as long."""

    replica_id: str
    shard: str
    fingerprints: frozenset[Fingerprint]  # the adapters it takes requests for
    in_flight: int = 0
    is_healthy: bool = True  # False: it failed a request lately (the gateway's cool-down)
    recent: float = 0.0  # requests routed here lately (exponentially decayed count)
    num_seq_slots: int = 1 << 30  # requests it runs at once; more wait in its queue
    capacity: int = 1 << 30  # requests it may hold: its sequence slots plus its queue
    is_reachable: bool = True  # False: known gone (its channel failed, and it has not been heard from since)
    # where it has each adapter (DEVICE, HOST; absent: LOWER); None: it keeps every adapter it serves on its device
    tiers: Mapping[Fingerprint, int] | None = None

    def tier(self, fingerprints: Collection[Fingerprint]) -> int:
        """The lowest tier one of `fingerprints` is on here (DEVICE when there is none)."""
        tiers = self.tiers
        if tiers is None or not fingerprints:
            return DEVICE
        return max(tiers.get(fp, LOWER) for fp in fingerprints)

    @property
    def has_free_seq_slot(self) -> bool:
        return self.in_flight < self.num_seq_slots

    @property
    def load(self) -> float:
        return self.in_flight + self.recent


class Residents(Mapping[Fingerprint, int]):
    """Where a worker with tiers has its adapters (routing's DEVICE, HOST; absent: lower), as it last
    reported (worker/engine/residency.py: `state`) and as this gateway's requests to it have changed
    it since: an adapter a request was sent for comes onto its device, and the least recently used
    ones past the device's capacity leave it, as the worker's own eviction does (with several
    gateways, each follows its own requests until the next report)."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.device: OrderedDict[Fingerprint, None] = OrderedDict.fromkeys(report.get("device", ()))  # least recent first
        self.host = frozenset(report.get("host", ()))
        self.hot = frozenset(report.get("hot", ()))
        self.capacity = int(report.get("capacity", len(self.device)))

    def promoted(self, fingerprints: Iterable[Fingerprint]) -> None:
        fingerprints = frozenset(fingerprints)
        for fingerprint in fingerprints:
            self.device[fingerprint] = None
            self.device.move_to_end(fingerprint)
        for fingerprint in list(self.device):
            if len(self.device) <= self.capacity:
                break
            if fingerprint not in self.hot and fingerprint not in fingerprints:
                del self.device[fingerprint]

    def get(self, fingerprint: Fingerprint, default: Any = None) -> Any:  # ReplicaView.tier's (faster than Mapping's)
        if fingerprint in self.device:
            return DEVICE
        return HOST if fingerprint in self.host else default

    def __getitem__(self, fingerprint: Fingerprint) -> int:
        if fingerprint in self.device:
            return DEVICE
        if fingerprint in self.host:
            return HOST
        raise KeyError(fingerprint)

    def __iter__(self) -> Iterator[Fingerprint]:
        return iter(self.device.keys() | self.host)

    def __len__(self) -> int:
        return len(self.device.keys() | self.host)


class RecentLoad:
    """Requests routed to each replica, decaying with half-life `half_life_s` (the clock is passed in).
    Counts are kept scaled to one moment, so reading every replica's at one time costs one power
    (a gateway reads hundreds per request); past REBASE half-lives they are scaled to a later one."""

    REBASE = 256.0  # half-lives (a float holds 2 ** 1023)

    def __init__(self, half_life_s: float) -> None:
        self.half_life_s = half_life_s
        self._values: dict[str, float] = {}  # count x 2 ** ((when - origin) / half-life)
        self._origin_s: float | None = None
        self._at_s, self._scale = float("nan"), 1.0  # the last moment read, and 2 ** -((it - origin) / half-life)

    def _scale_at(self, now_s: float) -> float:
        if now_s != self._at_s:
            if self._origin_s is None:
                self._origin_s = now_s
            exponent = (now_s - self._origin_s) / self.half_life_s
            if exponent > self.REBASE:  # scale the counts to now; those below 2 ** -40 of a request are gone
                scale = 0.5 ** exponent
                self._values = {k: v * scale for k, v in self._values.items() if v * scale > 1e-12}
                self._origin_s, exponent = now_s, 0.0
            self._at_s, self._scale = now_s, 0.5 ** exponent
        return self._scale

    def get(self, replica_id: str, now_s: float) -> float:
        value = self._values.get(replica_id)
        return 0.0 if value is None else value * self._scale_at(now_s)

    def get_many(self, replica_ids: Iterable[str], now_s: float) -> list[float]:
        """`get` of each of `replica_ids`, in their order."""
        scale, values = self._scale_at(now_s), self._values
        return [values.get(replica_id, 0.0) * scale for replica_id in replica_ids]

    def add(self, replica_id: str, now_s: float) -> None:
        scale = self._scale_at(now_s)  # first: it may rescale the counts
        self._values[replica_id] = self._values.get(replica_id, 0.0) + 1.0 / scale


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


def affinity_key(adapter_set_fingerprint: str, prompt_ids: Sequence[int], chunk_tokens: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(adapter_set_fingerprint.encode())
    h.update(b"\0")
    h.update(",".join(map(str, prompt_ids[:chunk_tokens])).encode())
    return h.digest()


_MASK64 = (1 << 64) - 1
_replica_hashes: dict[str, int] = {}  # replica id -> its hash (a gateway sees a few hundred ids at most)


def _replica_hash(replica_id: str) -> int:
    h = _replica_hashes.get(replica_id)
    if h is None:
        if len(_replica_hashes) >= 1 << 16:
            _replica_hashes.clear()
        h = _replica_hashes[replica_id] = int.from_bytes(hashlib.blake2b(replica_id.encode(), digest_size=8).digest(), "big")
    return h


def _rank(key_hash: int, replica_id: str) -> int:
    """A replica's rendezvous weight for a key (its hash: the affinity key is one already): the two
    hashes combined and mixed by splitmix64's finalizer, so a request over hundreds of replicas
    hashes nothing per replica."""
    x = key_hash ^ _replica_hash(replica_id)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_VECTOR_FROM = 32  # pools this large are ranked with numpy (the same figures as _rank, several times faster)


def _ranks(key_hash: int, pool: Sequence[ReplicaView]) -> list[int]:
    """`_rank` of each replica of `pool`, in its order."""
    if len(pool) < _VECTOR_FROM:
        return [_rank(key_hash, r.replica_id) for r in pool]
    hashes = _replica_hashes
    x = np.array([hashes.get(r.replica_id) or _replica_hash(r.replica_id) for r in pool], dtype=np.uint64)
    x ^= np.uint64(key_hash)
    x = (x ^ (x >> _U30)) * _U_MIX1  # uint64 arithmetic wraps: the `& _MASK64` above
    x = (x ^ (x >> _U27)) * _U_MIX2
    return (x ^ (x >> _U31)).tolist()


_U27, _U30, _U31 = np.uint64(27), np.uint64(30), np.uint64(31)
_U_MIX1, _U_MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def choose(pool: Sequence[ReplicaView], key: bytes, settings: RoutingSettings = RoutingSettings(), *,
           rng: random_module.Random | None = None, shared_cache: bool = True,
           fingerprints: Collection[Fingerprint] = ()) -> ReplicaView:
    """One replica of `pool` (non-empty candidates) for a request with affinity `key` and adapters
    `fingerprints`, by `settings.policy` (and, for affinity, its bound `settings.eps`).
    `shared_cache`: every replica can fetch every prefix (Redis); without it, affinity does
    not spill a request to an idle replica, where its prefix would be computed again.
    Each replica's load and rank are read once (a fleet's gateway routes over hundreds)."""
    if not pool:
        raise NoCandidateError("no candidate replicas")
    if settings.policy == "random":
        return (rng or random_module).choice(list(pool))
    key_hash = int.from_bytes(key[:8], "big")
    if settings.policy == "least_loaded":
        return min(pool, key=lambda r: (r.in_flight, _rank(key_hash, r.replica_id)))
    eps, n = settings.eps, len(pool)
    in_flight = [r.in_flight for r in pool]
    loads = [f + r.recent for f, r in zip(in_flight, pool)]
    load_bound = max(1.0, (1 + eps) * (sum(loads) + 1) / n)  # (1 + eps) x the mean once this request is added, >= 1
    in_flight_bound = max(1.0, (1 + eps) * (sum(in_flight) + 1) / n)
    ranks = _ranks(key_hash, pool)
    not_busy = ranked = sorted(range(n), key=ranks.__getitem__, reverse=True)  # indices, best rank first
    if shared_cache:  # never queue behind a full replica's slots while another has one free: start soonest
        ranked = [i for i in ranked if in_flight[i] < pool[i].num_seq_slots] or ranked
        not_busy = [i for i in ranked if in_flight[i] + 1 <= in_flight_bound] or [min(ranked, key=in_flight.__getitem__)]
    if fingerprints:
        tiers = [pool[i].tier(fingerprints) for i in not_busy]
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

