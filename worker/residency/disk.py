"""The disk tier: this node's copies of the adapter store's files when the store is elsewhere (a
store that is this node's own directory has every file here), least recently used first within the
disk budget. Copies left by an earlier process count too. Only with tiers."""

from __future__ import annotations

from collections.abc import Collection

from cache.blobs import BlobStore
from cache.lru import LRUBytes
from worker.contract.identity import Fingerprint
from worker.contract.spec import ResidencySettings
from worker.residency.stats import ResidencyStats


class DiskTier:
    def __init__(self, store: BlobStore | None, settings: ResidencySettings, stats: ResidencyStats) -> None:
        self.store, self.settings, self.stats = store, settings, stats
        self.copies: LRUBytes[Fingerprint, None] = LRUBytes()
        if store is not None and settings.is_tiered:  # least recently modified first
            for fingerprint, (size, _) in sorted(store.copies().items(), key=lambda item: item[1][1]):
                self.copies.put(Fingerprint(fingerprint), None, size)

    def __contains__(self, fingerprint: object) -> bool:
        return fingerprint in self.copies

    def resident(self) -> tuple[int, int]:
        """(adapters, bytes) here."""
        return len(self.copies), self.copies.num_bytes

    def touch(self, fingerprint: Fingerprint, keep: Collection[Fingerprint] = ()) -> None:
        """This node holds a copy of `fingerprint` now: past the budget, the least recently used others,
        not those in `keep` (adapters coming up), are dropped."""
        if self.store is None or self.store.is_local or not self.settings.is_tiered:
            return
        try:
            self.copies.put(fingerprint, None, self.store.path(fingerprint).stat().st_size)
        except FileNotFoundError:
            return
        if self.settings.disk_bytes is not None:
            for other in self.copies.trim(self.settings.disk_bytes, keep={fingerprint, *keep}):
                self.store.drop_copy(other)
                self.stats.evictions["disk"] += 1

    def drop(self, fingerprint: Fingerprint) -> None:
        """Delete this node's copy (an adapter no longer served)."""
        if fingerprint in self.copies:
            self.copies.pop(fingerprint)
            self.store.drop_copy(fingerprint)
