"""The host tier: adapters read, scaled and (a DoRA) with their norms made (worker/lora/attach.py:
`host_halves`), ready to copy to the device, least recently used first within the host budget. An
adapter is kept here when it is read, so an eviction from the device copies nothing. On a GPU they are
page-locked (`pinned`), so the copy up runs on a side stream. Only with tiers: without, nothing leaves
the device and none is kept here."""

from __future__ import annotations

from cache.lru import LRUBytes
from worker.contract.identity import Fingerprint
from worker.contract.spec import ResidencySettings
from worker.lora.attach import HostHalves, host_nbytes, pinned
from worker.residency.stats import ResidencyStats


class HostTier:
    def __init__(self, settings: ResidencySettings, stats: ResidencyStats, is_cuda: bool) -> None:
        self.settings, self.stats, self.is_cuda = settings, stats, is_cuda
        self.entries: LRUBytes[Fingerprint, HostHalves] = LRUBytes()

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self.entries

    def resident(self) -> tuple[int, int]:
        """(adapters, bytes) here."""
        return len(self.entries), self.entries.num_bytes

    def get(self, fingerprint: Fingerprint) -> HostHalves | None:
        """Its halves, made the most recently used; None when it is not here."""
        return self.entries.get(fingerprint)

    def keep(self, fingerprint: Fingerprint, host: HostHalves) -> None:
        """Keep `host` for the next promotion; past the budget, the least recently used others go."""
        budget = self.settings.host_bytes
        if not self.settings.is_tiered or budget == 0:
            return
        self.entries.put(fingerprint, pinned(host) if self.is_cuda else host, host_nbytes(host))
        if budget is not None:
            held_bytes = self.entries.num_bytes
            self.stats.evictions["host"] += len(self.entries.trim(budget))
            self.stats.evicted_bytes["host"] += held_bytes - self.entries.num_bytes

    def drop(self, fingerprint: Fingerprint) -> None:
        held_bytes = self.entries.num_bytes
        self.entries.pop(fingerprint)
        self.stats.evicted_bytes["host"] += held_bytes - self.entries.num_bytes
