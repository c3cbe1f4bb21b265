"""What routing sees of a replica at one moment (ReplicaView), and where a worker with tiers has
its adapters (Residents): the gateway's model of it, from the worker's reports and the requests
sent to it since."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from worker.contract.identity import Fingerprint

DEVICE, HOST, LOWER = 0, 1, 2  # where a replica has an adapter (worker/residency/; disk and the store: LOWER)


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
    def load(self) -> float:
        return self.in_flight + self.recent


class Residents(Mapping[Fingerprint, int]):
    """Where a worker with tiers has its adapters (DEVICE, HOST; absent: lower), as it last
    reported (worker/residency/residency.py: `state`) and as this gateway's requests to it have changed
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
