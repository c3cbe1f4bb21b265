"""Which adapters a shard replica serves, and on which tier each one is.

The gateway decides what a replica serves; the replica's adapter slots change between engine steps,
never under a running request. Adapters are known by their content fingerprint: a replaced adapter is
a new fingerprint beside the old one, so requests already running on the old version finish on it and
no request ever mixes the two. `sync` takes the whole set the gateway wants served, with a version
number (an older version, from a gateway that lags, is ignored): a new one is fetched from the adapter
store into this node's cache (cache/blobs.py: verified against the digest recorded when it was stored),
read and its fingerprint checked off the engine's thread; one that cannot be fetched or read is
reported in `failed` with the reason. One no longer wanted is no longer reported as served (no gateway
that has seen the change routes to it), still serves requests from gateways that have not yet, and is
dropped once no request uses it and a grace period has passed.

`acquire` leases a request's adapters on the device, bringing up (promotion.py) those that are not.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import Any

from cache.blobs import BlobStore, BlobStoreError
from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import ResidencySettings
from worker.engine.loop import EngineLoop
from worker.formats.adapter import LoRAAdapter, load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.lora.attach import HostHalves, host_halves
from worker.residency.device import DeviceTier, Lease
from worker.residency.disk import DiskTier
from worker.residency.host import HostTier
from worker.residency.memory import HostMemory
from worker.residency.promotion import Promotions, evictor_of
from worker.residency.sizes import device_nbytes
from worker.residency.stats import ResidencyStats

log = logging.getLogger(__name__)
DRAIN_GRACE_S = 2.0  # an unwanted adapter is kept at least this long: a request routed just before may still arrive


class NotHeld(LookupError):
    """The request names an adapter this replica does not serve (any more, or yet): another may."""


def closed(adapter: LoRAAdapter) -> LoRAAdapter:
    """What the replica keeps of `adapter` (its facts, not its open file: a replica may serve thousands)."""
    return replace(adapter, gguf=None, base=None)


class Residency:
    def __init__(self, loop: EngineLoop, base: GGUFFile, store: BlobStore | None,
                 settings: ResidencySettings = ResidencySettings(), clock: Callable[[], float] = time.monotonic,
                 memory: HostMemory | None = None) -> None:
        """The runner's adapters when built (the deploy-time pins) are served and on the device from
        the start, for good; any other comes from `store` (None: none can). `memory`: the bound on the
        process's memory (memory.py; default: bounded)."""
        self.loop, self.base, self.store, self.settings, self.clock = loop, base, store, settings, clock
        runner = loop.engine.runner
        self.config = runner.config
        self.stats = ResidencyStats()
        self.memory = HostMemory() if memory is None else memory
        pins = [(Fingerprint(a.fingerprint), AdapterSlot(slot), runner.lora.nbytes(slot)) for slot, a in runner.adapters.items()]
        self.device = DeviceTier(settings, self.stats, pins)
        self.host = HostTier(settings, self.stats, is_cuda=self.config.torch_device.type == "cuda")
        self.disk = DiskTier(store, settings, self.stats)
        self.promotions = Promotions(loop, self.device, self.host, self.disk, self.stats, self.tier_of, clock, self.memory)
        self.known: dict[Fingerprint, LoRAAdapter] = {Fingerprint(a.fingerprint): a for a in runner.adapters.values()}
        self.nbytes: dict[Fingerprint, int] = {fp: nbytes for fp, _, nbytes in pins}  # each one's device bytes
        self.draining: dict[Fingerprint, float] = {}  # when it was no longer wanted
        self.failed: dict[Fingerprint, str] = {}  # why it could not be loaded
        self.version = -1
        self._lock = asyncio.Lock()

    # what it serves, and where

    @property
    def held(self) -> list[Fingerprint]:
        """Fingerprints that take new requests (on any tier)."""
        return sorted(fp for fp in self.known if fp not in self.draining)

    def tier_of(self, fingerprint: Fingerprint) -> str:
        if fingerprint in self.device:
            return "device"
        if fingerprint in self.host:
            return "host"
        if self.store is not None and (self.store.is_local or fingerprint in self.disk or not self.settings.is_tiered):
            return "disk"
        return "store"

    def state(self) -> dict[str, Any]:
        """What it serves; with tiers, which of them are on the device (least recently used first) and on the
        host (the others: on disk or in the store), the deploy-time ones, and about how many adapters the
        device holds: the gateway routes to a replica that has an adapter nearest, and follows its evictions
        between two reports."""
        state = {"version": self.version, "held": self.held, "draining": sorted(self.draining), "failed": dict(self.failed)}
        if self.settings.is_tiered:
            state["tiers"] = {"device": [fp for fp in self.device.listed() if fp not in self.draining],
                              "host": sorted(fp for fp in self.host.entries if fp not in self.draining),
                              "hot": sorted(self.device.hot), "capacity": self.capacity()}
        return state

    def capacity(self) -> int:
        """Adapters the device holds at most: its count budget, or its byte budget over the mean adapter's bytes."""
        s, sizes = self.settings, list(self.nbytes.values())
        limits = [s.device_adapters] if s.device_adapters is not None else []
        if s.device_bytes is not None:
            limits.append(s.device_bytes * len(sizes) // max(1, sum(sizes)) if sizes else s.device_bytes)
        return min(limits) if limits else len(self.known)

    def residents(self) -> dict[str, tuple[int, int]]:
        """Per tier: (adapters, bytes) (metrics)."""
        return {"device": self.device.resident(), "host": self.host.resident(), "disk": self.disk.resident()}

    # changing what it serves

    async def sync(self, version: int, wanted: Iterable[Fingerprint]) -> dict[str, Any]:
        """Serve exactly `wanted` from now on; returns what it serves now."""
        async with self._lock:
            if version >= self.version:
                self.version = version
                wanted = dict.fromkeys(wanted)  # in the order given
                for fingerprint in [fp for fp in self.known if fp not in wanted and fp not in self.draining]:
                    self.draining[fingerprint] = self.clock()
                for fingerprint in wanted:
                    self.draining.pop(fingerprint, None)  # wanted again before it was dropped
                    if fingerprint not in self.known:
                        await self._admit(fingerprint)
                await self.promotions.settle_memory()  # the host tier may have evicted while they were read
                self._reap_later()
            return self.state()

    async def _admit(self, fingerprint: Fingerprint) -> None:
        """Fetch, read and check a newly wanted adapter; put it on the device while there is room
        (without evicting anything), else keep what fits lower down."""
        source = "no adapter store" if self.store is None else self.store.url
        try:
            if self.store is None:
                raise BlobStoreError(f"adapter {fingerprint} is not a deploy-time adapter and this replica has no adapter store")
            adapter, _ = await self.memory.run(self._read, fingerprint, False)
            self.disk.touch(fingerprint, keep=self.promotions.loading)
            self.known[fingerprint] = closed(adapter)
            self.nbytes[fingerprint] = nbytes = device_nbytes(adapter, self.config.torch_dtype)
            keeps_host = self.settings.is_tiered and self.settings.host_bytes != 0
            if self.device.fits(nbytes) or keeps_host:  # read it now (a thread), for the device or the host
                host = await self.memory.run(host_halves, adapter)
                self.host.keep(fingerprint, host)
                if self.device.fits(nbytes):
                    await self.promotions.install(fingerprint, self.known[fingerprint], nbytes, host, may_evict=False)
        except Exception as e:  # not in the store, a changed file, no memory: this one is not served, the others are
            log.warning("adapter %s from %s could not be loaded: %s", fingerprint[:16], source, e)
            self.failed[fingerprint] = str(e)[:300]
            self.known.pop(fingerprint, None)
            self.host.drop(fingerprint)
            return
        self.failed.pop(fingerprint, None)

    def _read(self, fingerprint: Fingerprint, halves: bool = True) -> tuple[LoRAAdapter, HostHalves | None]:
        """(the adapter, its host halves if `halves`) from this node's copy, fetched first when there is none
        (a thread)."""
        path = self.store.fetch(fingerprint)
        adapter = load_adapter(path, self.base)
        if adapter.fingerprint != fingerprint:
            raise ValueError(f"the file's fingerprint is {adapter.fingerprint[:16]}, not {fingerprint[:16]}")
        return adapter, host_halves(adapter) if halves else None

    async def reap(self) -> None:
        """Drop the unwanted adapters no request uses any more (past their grace period)."""
        async with self._lock:
            now = self.clock()
            due = [fp for fp, since in self.draining.items()
                   if now - since >= DRAIN_GRACE_S and fp not in self.promotions.loading]
            if not due:
                return
            drop = self.loop.call(lambda engine: self.device.drop_unused(due, evictor_of(engine, self.loop)))
            for fingerprint in await asyncio.wrap_future(drop):
                del self.known[fingerprint], self.draining[fingerprint]
                self.nbytes.pop(fingerprint, None)
                self.host.drop(fingerprint)
                self.disk.drop(fingerprint)
            await self.promotions.settle_memory()
            self._reap_later()  # some may still run: look again later

    def _reap_later(self) -> None:
        if self.draining:
            asyncio.get_running_loop().call_later(DRAIN_GRACE_S, lambda: asyncio.ensure_future(self.reap()))

    # a request's adapters

    async def acquire(self, fingerprints: Iterable[Fingerprint], timeout_s: float | None = None) -> Lease:
        """The device slots of `fingerprints` (a request's adapters), leased: those not on the device
        come up first. NotHeld for one it does not serve; Overloaded when one cannot come up in time."""
        fingerprints = list(dict.fromkeys(fingerprints))
        for fingerprint in fingerprints:
            if fingerprint not in self.known:
                raise NotHeld(f"adapter {fingerprint!r} is not loaded on this replica")
        started = self.clock()
        until = started + min(self.settings.load_timeout_s, timeout_s or self.settings.load_timeout_s)
        lease, came_up = Lease(self.device), False
        try:
            for fingerprint in fingerprints:
                slot = self.device.lease(fingerprint)
                while slot is None:  # not on the device (or evicted again before this request could lease it)
                    came_up = True
                    read = partial(self._read, fingerprint)
                    await self.promotions.come_up(fingerprint, self.known[fingerprint], self.nbytes[fingerprint], read, until)
                    slot = self.device.lease(fingerprint)
                lease.slots[fingerprint] = slot
        except BaseException:
            lease.release()
            raise
        if came_up:
            lease.waited_s = self.clock() - started
            self.stats.waited += 1
        return lease
