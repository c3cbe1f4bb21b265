"""Which adapters a shard replica holds, changed while it runs (SPEC §1: the control plane
decides; a pinned set changes between engine steps, never under a running request).

Adapters are known by their content fingerprint (SPEC §3): a replaced adapter is a new
fingerprint beside the old one, so requests already running on the old version finish
on it and no request ever mixes the two. `sync` takes the whole desired set of
fingerprints from the gateway with a version number (an older version, from a gateway that
lags, is ignored): a new pin is fetched from the adapter store into this node's cache
(cache/blobs.py: verified against the digest recorded when it was stored), read and its
fingerprint checked off the engine's thread, then put in a free adapter slot between steps;
one that cannot be fetched or loaded is reported in `failed` with the reason. An unpinned
adapter is no longer reported as held (so no gateway that has seen the change routes to
it), still serves requests from gateways that have not yet, and is dropped once no request
uses it and a grace period has passed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from cache.blobs import BlobStore, BlobStoreError
from worker.contract.identity import AdapterSlot, Fingerprint
from worker.engine.engine import Engine
from worker.engine.loop import EngineLoop
from worker.formats.adapter import LoRAAdapter, load_adapter
from worker.lora.attach import host_halves
from worker.formats.gguf_file import GGUFFile

log = logging.getLogger(__name__)
DRAIN_GRACE_S = 2.0  # an unpinned adapter is kept at least this long: a request routed just before may still arrive


class NotHeld(LookupError):
    """The request names an adapter this replica does not hold (any more, or yet): another may."""


class Pins:
    def __init__(self, loop: EngineLoop, base: GGUFFile, store: BlobStore | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """The runner's adapters when built (the deploy-time pins) are held from the start; any
        other comes from `store` (None: none can)."""
        self.loop, self.base, self.store, self.clock = loop, base, store, clock
        runner = loop.engine.runner
        self.slots: dict[Fingerprint, AdapterSlot] = {Fingerprint(a.fingerprint): AdapterSlot(slot) for slot, a in runner.adapters.items()}
        self.draining: dict[Fingerprint, float] = {}  # when it was unpinned
        self.failed: dict[Fingerprint, str] = {}  # why it could not be loaded
        self.version = -1
        self._lock = asyncio.Lock()

    def slot_of(self, fingerprint: Fingerprint) -> AdapterSlot:
        """Its slot while it is loaded (draining included: a request routed just before the change)."""
        slot = self.slots.get(fingerprint)
        if slot is None:
            raise NotHeld(f"adapter {fingerprint!r} is not loaded on this replica")
        return slot

    @property
    def held(self) -> list[Fingerprint]:
        """Fingerprints that take new requests."""
        return sorted(fp for fp in self.slots if fp not in self.draining)

    async def sync(self, version: int, pins: Iterable[Fingerprint]) -> dict[str, Any]:
        """Make the held set `pins`; returns what is held now."""
        async with self._lock:
            if version >= self.version:
                self.version = version
                wanted = dict.fromkeys(pins)  # in the order given
                for fingerprint in [fp for fp in self.slots if fp not in wanted and fp not in self.draining]:
                    self.draining[fingerprint] = self.clock()
                for fingerprint in wanted:
                    self.draining.pop(fingerprint, None)  # pinned again before it was dropped
                    if fingerprint not in self.slots:
                        await self._load(fingerprint)
                self._reap_later()
            return self.state()

    def state(self) -> dict[str, Any]:
        return {"version": self.version, "held": self.held, "draining": sorted(self.draining), "failed": dict(self.failed)}

    async def _load(self, fingerprint: Fingerprint) -> None:
        source = "no adapter store" if self.store is None else self.store.url
        try:
            if self.store is None:
                raise BlobStoreError(f"adapter {fingerprint} is not a deploy-time adapter and this replica has no adapter store")
            path = await asyncio.to_thread(self.store.fetch, fingerprint)
            adapter: LoRAAdapter = await asyncio.to_thread(load_adapter, path, self.base)
            if adapter.fingerprint != fingerprint:
                raise ValueError(f"the file's fingerprint is {adapter.fingerprint[:16]}, not {fingerprint[:16]}")
            host = await asyncio.to_thread(host_halves, adapter)  # reads and DoRA norms: off the step loop
            slot = await asyncio.wrap_future(self.loop.call(lambda engine: engine.runner.add_adapter(adapter, host)))
        except Exception as e:  # not in the store, a changed file, no memory: this pin is not held, the others are
            log.warning("adapter %s from %s could not be loaded: %s", fingerprint[:16], source, e)
            self.failed[fingerprint] = str(e)[:300]
            return
        self.failed.pop(fingerprint, None)
        self.slots[fingerprint] = slot

    async def reap(self) -> None:
        """Drop the unpinned adapters no request uses any more (past their grace period)."""
        async with self._lock:
            now = self.clock()
            due = {fp: self.slots[fp] for fp, since in self.draining.items() if now - since >= DRAIN_GRACE_S}
            if not due:
                return

            def drop(engine: Engine) -> list[Fingerprint]:
                busy = engine.adapter_slots_in_use() | self.loop.pending_adapter_slots()
                dropped = [fp for fp, slot in due.items() if slot not in busy]
                for fp in dropped:
                    engine.runner.remove_adapter(due[fp])
                return dropped

            for fingerprint in await asyncio.wrap_future(self.loop.call(drop)):
                del self.slots[fingerprint], self.draining[fingerprint]
            self._reap_later()  # some may still run: look again later

    def _reap_later(self) -> None:
        if self.draining:
            asyncio.get_running_loop().call_later(DRAIN_GRACE_S, lambda: asyncio.ensure_future(self.reap()))
