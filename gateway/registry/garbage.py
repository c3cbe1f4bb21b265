"""The adapter files in the store that nothing needs any more (torch-free): `StoredFiles` deletes
those no record pins, no worker still holds and this gateway is not registering, once old enough
that no other gateway's staging is under way (storing a file again makes it new; ages are
wall-clock time)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Set
from contextlib import asynccontextmanager

from cache.blobs import BlobStore, BlobStoreError
from worker.contract.identity import Fingerprint

log = logging.getLogger(__name__)


class StoredFiles:
    def __init__(self, store: BlobStore, garbage_age_s: float) -> None:
        self.store, self.garbage_age_s = store, garbage_age_s
        self._staging: Counter[Fingerprint] = Counter()  # adapters being registered here: their files are kept
        self._collecting = asyncio.Lock()

    @asynccontextmanager
    async def staging(self, fingerprint: Fingerprint) -> AsyncIterator[None]:
        """While an adapter is registered here (stored, and no record names it yet): its file is kept."""
        async with self._collecting:  # a collection under way ends before the file is stored
            self._staging[fingerprint] += 1
        try:
            yield
        finally:
            self._staging[fingerprint] -= 1
            if not self._staging[fingerprint]:
                del self._staging[fingerprint]

    async def collect(self, kept: Set[Fingerprint]) -> None:
        """Delete the old enough files not in `kept` nor staged here; a store that cannot be reached
        is tried again next time."""
        try:
            async with self._collecting:
                stored = await asyncio.to_thread(self.store.list_blobs)
                now_s = time.time()
                for fingerprint, stored_at_s in stored.items():
                    is_kept = fingerprint in kept or fingerprint in self._staging
                    if not is_kept and now_s - stored_at_s > self.garbage_age_s:
                        await asyncio.to_thread(self.store.delete, fingerprint)
        except BlobStoreError as e:
            log.warning("adapter files not collected: %s", e)
