"""Which adapters a shard replica serves, and where it keeps each of them (SPEC §1: the control
plane decides what a replica serves; its adapter slots change between engine steps, never under
a running request).

What it serves. Adapters are known by their content fingerprint (SPEC §3): a replaced adapter
is a new fingerprint beside the old one, so requests already running on the old version finish
on it and no request ever mixes the two. `sync` takes the whole set the gateway wants served,
with a version number (an older version, from a gateway that lags, is ignored): a new one is
fetched from the adapter store into this node's cache (cache/blobs.py: verified against the
digest recorded when it was stored), read and its fingerprint checked off the engine's thread;
one that cannot be fetched or read is reported in `failed` with the reason. One no longer
wanted is no longer reported as served (no gateway that has seen the change routes to it),
still serves requests from gateways that have not yet, and is dropped once no request uses it
and a grace period has passed.

Where it keeps them: in tiers, each with a budget (ResidencySettings; none: no limit, and every
adapter served stays on the device, as before tiers):
- device: in one of the runner's adapter slots, what a pass can use;
- host: read, scaled, a DoRA's norms made (`host_halves`), ready to copy (kept when an adapter
  is read, so an eviction from the device copies nothing);
- disk: this node's copy of the store's file (every file, when the store is this node's own
  directory);
- the store: the tier below.
A request for an adapter that is not on the device waits, its deadline counting, while the
adapter comes up: read off the step loop, room on the device reserved for it, copied there off
the step loop (worker/lora/attach.py: `device_halves`, on a GPU on a side stream), then put in a
slot between two steps, which only wires it in; no other request's step waits for it. The room
is taken before the copy starts, so the adapters on the device and those being copied there
never pass the device's budget together, however many come up at once. Room is made by evicting
the least recently used adapters that no running, waiting or arriving request uses; when every
one there is in use, the request waits for one to be free (`load_timeout_s`, then 503). The
deploy-time adapters (the operator's pins) never leave the device. The host and disk tiers
drop their least recently used copies past their budgets.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from cache.blobs import BlobStore, BlobStoreError
from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import ResidencySettings
from worker.engine.engine import Engine
from worker.engine.loop import EngineLoop, Overloaded
from worker.engine.tiers import ByteLRU, ResidencyStats, closed, device_nbytes
from worker.formats.adapter import LoRAAdapter, load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.lora.attach import HostHalves, device_halves, host_halves, host_nbytes, pinned

log = logging.getLogger(__name__)
DRAIN_GRACE_S = 2.0  # an unwanted adapter is kept at least this long: a request routed just before may still arrive
ROOM_POLL_S = 0.01  # how often a promotion that found every adapter on the device in use looks again


class NotHeld(LookupError):
    """The request names an adapter this replica does not serve (any more, or yet): another may."""


class Lease:
    """The device slots of one request's adapters, kept from eviction until `release` (once the
    request is in the engine's hands, which keeps them itself)."""

    def __init__(self, residency: Residency) -> None:
        self.residency = residency
        self.slots: dict[Fingerprint, AdapterSlot] = {}
        self.waited_s = 0.0  # how long it waited for adapters to come up

    def release(self) -> None:
        self.residency._unlease(self.slots)
        self.slots = {}


class Residency:
    def __init__(self, loop: EngineLoop, base: GGUFFile, store: BlobStore | None,
                 settings: ResidencySettings = ResidencySettings(), clock: Callable[[], float] = time.monotonic) -> None:
        """The runner's adapters when built (the deploy-time pins) are served and on the device from
        the start, for good; any other comes from `store` (None: none can)."""
        self.loop, self.base, self.store, self.settings, self.clock = loop, base, store, settings, clock
        runner = loop.engine.runner
        self.config = runner.config
        self._guard = threading.Lock()  # the device tier: read and changed by the event loop and the engine's thread
        self._device: ByteLRU[Fingerprint, AdapterSlot] = ByteLRU()
        self._leased: dict[Fingerprint, int] = {}
        self._reserved: dict[int, int] = {}  # reservation -> the device bytes of a copy under way, counted before it starts
        self._reservation_ids = itertools.count()
        for slot, adapter in runner.adapters.items():
            self._device.put(Fingerprint(adapter.fingerprint), AdapterSlot(slot), runner.lora.nbytes(slot))
        self.hot = frozenset(self._device)  # never evicted
        self.known: dict[Fingerprint, LoRAAdapter] = {Fingerprint(a.fingerprint): a for a in runner.adapters.values()}
        self.nbytes: dict[Fingerprint, int] = {fp: nbytes for fp, _, nbytes in self._device.items()}  # each one's device bytes
        self._host: ByteLRU[Fingerprint, HostHalves] = ByteLRU()
        self._disk: ByteLRU[Fingerprint, None] = ByteLRU()  # this node's copies of a store elsewhere
        if store is not None and self.settings.is_tiered:  # copies left by an earlier process count too
            for fingerprint, (size, _) in sorted(store.copies().items(), key=lambda item: item[1][1]):
                self._disk.put(Fingerprint(fingerprint), None, size)
        self._loading: dict[Fingerprint, asyncio.Future] = {}  # promotions under way
        self.draining: dict[Fingerprint, float] = {}  # when it was no longer wanted
        self.failed: dict[Fingerprint, str] = {}  # why it could not be loaded
        self.stats = ResidencyStats()
        self.version = -1
        self._lock = asyncio.Lock()

    # what it serves

    @property
    def held(self) -> list[Fingerprint]:
        """Fingerprints that take new requests (on any tier)."""
        return sorted(fp for fp in self.known if fp not in self.draining)

    def tier_of(self, fingerprint: Fingerprint) -> str:
        if fingerprint in self._device:
            return "device"
        if fingerprint in self._host:
            return "host"
        if self.store is not None and (self.store.is_local or fingerprint in self._disk or not self.settings.is_tiered):
            return "disk"
        return "store"

    def state(self) -> dict[str, Any]:
        """What it serves; with tiers, which of them are on the device (least recently used first) and on the
        host (the others: on disk or in the store), the deploy-time ones, and about how many adapters the
        device holds: the gateway routes to a replica that has an adapter nearest, and follows its evictions
        between two reports."""
        state = {"version": self.version, "held": self.held, "draining": sorted(self.draining), "failed": dict(self.failed)}
        if self.settings.is_tiered:
            with self._guard:
                device = [fp for fp in self._device if fp not in self.draining]
            state["tiers"] = {"device": device, "host": sorted(fp for fp in self._host if fp not in self.draining),
                              "hot": sorted(self.hot), "capacity": self.capacity()}
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
        with self._guard:
            device = (len(self._device), self._device.total)
        return {"device": device, "host": (len(self._host), self._host.total), "disk": (len(self._disk), self._disk.total)}

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
                self._reap_later()
            return self.state()

    async def _admit(self, fingerprint: Fingerprint) -> None:
        """Fetch, read and check a newly wanted adapter; put it on the device while there is room
        (without evicting anything), else keep what fits lower down."""
        source = "no adapter store" if self.store is None else self.store.url
        try:
            if self.store is None:
                raise BlobStoreError(f"adapter {fingerprint} is not a deploy-time adapter and this replica has no adapter store")
            adapter, _ = await asyncio.to_thread(self._read, fingerprint, False)
            self._touch_disk(fingerprint)
            self.known[fingerprint] = closed(adapter)
            self.nbytes[fingerprint] = device_nbytes(adapter, self.config.torch_dtype)
            keeps_host = self.settings.is_tiered and self.settings.host_bytes != 0
            if self._fits(self.nbytes[fingerprint]) or keeps_host:  # read it now (a thread), for the device or the host
                host = await asyncio.to_thread(host_halves, adapter)
                self._keep_on_host(fingerprint, host)
                if self._fits(self.nbytes[fingerprint]):
                    await self._install(fingerprint, host, may_evict=False)
        except Exception as e:  # not in the store, a changed file, no memory: this one is not served, the others are
            log.warning("adapter %s from %s could not be loaded: %s", fingerprint[:16], source, e)
            self.failed[fingerprint] = str(e)[:300]
            self.known.pop(fingerprint, None)
            self._host.pop(fingerprint)
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

    # where it keeps them

    async def acquire(self, fingerprints: Iterable[Fingerprint], timeout_s: float | None = None) -> Lease:
        """The device slots of `fingerprints` (a request's adapters), leased: those not on the device
        come up first. NotHeld for one it does not serve; Overloaded when one cannot come up in time."""
        fingerprints = list(dict.fromkeys(fingerprints))
        for fingerprint in fingerprints:
            if fingerprint not in self.known:
                raise NotHeld(f"adapter {fingerprint!r} is not loaded on this replica")
        started = self.clock()
        until = started + min(self.settings.load_timeout_s, timeout_s or self.settings.load_timeout_s)
        lease, came_up = Lease(self), False
        try:
            for fingerprint in fingerprints:
                slot = self._lease(fingerprint)
                while slot is None:  # not on the device (or evicted again before this request could lease it)
                    came_up = True
                    await self._come_up(fingerprint, until)
                    slot = self._lease(fingerprint)
                lease.slots[fingerprint] = slot
        except BaseException:
            lease.release()
            raise
        if came_up:
            lease.waited_s = self.clock() - started
            self.stats.waited += 1
        return lease

    def _lease(self, fingerprint: Fingerprint) -> AdapterSlot | None:
        with self._guard:
            slot = self._device.get(fingerprint)
            if slot is not None:
                self._leased[fingerprint] = self._leased.get(fingerprint, 0) + 1
                self._device.touch(fingerprint)
            return slot

    def _unlease(self, slots: Iterable[Fingerprint]) -> None:
        with self._guard:
            for fingerprint in slots:
                left = self._leased.get(fingerprint, 0) - 1
                if left > 0:
                    self._leased[fingerprint] = left
                else:
                    self._leased.pop(fingerprint, None)

    async def _come_up(self, fingerprint: Fingerprint, until: float) -> None:
        """Bring `fingerprint` onto the device, or wait for the promotion already under way."""
        task = self._loading.get(fingerprint)
        if task is None:
            task = self._loading[fingerprint] = asyncio.ensure_future(self._promote(fingerprint, until))
            task.add_done_callback(lambda done: self._loading.pop(fingerprint, None) if self._loading.get(fingerprint) is done else None)
        await asyncio.shield(task)

    async def _promote(self, fingerprint: Fingerprint, until: float) -> None:
        started, source = self.clock(), self.tier_of(fingerprint)
        host = self._host.get(fingerprint)
        if host is not None:
            self._host.touch(fingerprint)
        else:
            try:
                _, host = await asyncio.to_thread(self._read, fingerprint)
            except Exception as e:
                raise Overloaded(f"adapter {fingerprint[:16]} could not be loaded: {str(e)[:200]}") from e
            self._touch_disk(fingerprint)
            self._keep_on_host(fingerprint, host)
        await self._install(fingerprint, host, may_evict=True, until=until)
        self.stats.promoted(source, self.clock() - started)

    async def _install(self, fingerprint: Fingerprint, host: HostHalves, may_evict: bool, until: float | None = None) -> None:
        """Reserve room on the device (`_reserve`), copy `host` into it (a thread), then take a slot between
        steps. Shielded: once begun it runs to its end, so no reservation or copy is left behind by a caller
        that is cancelled."""
        await asyncio.shield(asyncio.ensure_future(self._reserve_copy_install(fingerprint, host, may_evict, until)))

    async def _reserve_copy_install(self, fingerprint: Fingerprint, host: HostHalves, may_evict: bool, until: float | None) -> None:
        nbytes, adapter = self.nbytes[fingerprint], self.known[fingerprint]
        reservation = await self._reserve(fingerprint, nbytes, may_evict, until)
        if reservation is None:
            return  # on the device already, or (without `may_evict`) no room: it stays lower down
        try:
            halves = await asyncio.to_thread(device_halves, host, self.config)

            def install(engine: Engine) -> None:  # the engine's thread, between steps: the room reserved becomes its own
                with self._guard:
                    if self._reserved.pop(reservation, None) is not None and fingerprint not in self._device:
                        self._device.put(fingerprint, engine.runner.add_adapter(adapter, device=halves), nbytes)

            await asyncio.wrap_future(self.loop.call(install))
        finally:  # failed: the room is free again (installed: it is already)
            with self._guard:
                self._reserved.pop(reservation, None)

    async def _reserve(self, fingerprint: Fingerprint, nbytes: int, may_evict: bool, until: float | None) -> int | None:
        """Room on the device for `nbytes` more, taken for `fingerprint`'s copy (the reservation): free room
        at once; else, with `may_evict`, room made between steps by evicting, and while every adapter there
        is in use, waited for (Overloaded past `until`). None when it is on the device already, or when there
        is no room and `may_evict` is not set."""

        def evicting(engine: Engine) -> int | None:  # the engine's thread, between steps
            with self._guard:
                return None if fingerprint in self._device else self._take_room(nbytes, engine)

        while True:
            with self._guard:
                if fingerprint in self._device:
                    return None
                reservation = self._take_room(nbytes)
            if reservation is not None or not may_evict:
                return reservation
            reservation = await asyncio.wrap_future(self.loop.call(evicting))
            if reservation is not None:
                return reservation
            if self.clock() >= until and fingerprint not in self._device:
                raise Overloaded(f"no room on the device for adapter {fingerprint[:16]}: every adapter there is in use")
            await asyncio.sleep(ROOM_POLL_S)

    def _take_room(self, nbytes: int, engine: Engine | None = None) -> int | None:
        """Reserve `nbytes` on the device (under the guard): the reservation, or None when there is no room.
        With `engine` (its thread, between steps), room is made by evicting the least recently used adapters
        no request uses."""
        if not self._fits_now(nbytes):
            victims = None if engine is None else self._victims(engine, nbytes)
            if victims is None:
                return None
            for victim in victims:
                engine.runner.remove_adapter(self._device.pop(victim))
            self.stats.evictions["device"] += len(victims)
        reservation = next(self._reservation_ids)
        self._reserved[reservation] = nbytes
        return reservation

    def _victims(self, engine: Engine, nbytes: int) -> list[Fingerprint] | None:
        """Least recently used adapters to evict so that `nbytes` more fit (under the guard, on the engine's
        thread); None when those in use leave no room."""
        busy = engine.adapter_slots_in_use() | self.loop.pending_adapter_slots()
        over_bytes, over_count = self._over(nbytes)
        victims = []
        for fingerprint, slot, size in self._device.items():
            if over_bytes <= 0 and over_count <= 0:
                break
            if fingerprint in self.hot or self._leased.get(fingerprint) or slot in busy:
                continue
            victims.append(fingerprint)
            over_bytes -= size
            over_count -= 1
        return victims if over_bytes <= 0 and over_count <= 0 else None

    def _over(self, nbytes: int) -> tuple[int, int]:
        """(bytes, adapters) past the device's budget once `nbytes` more are there, beside those on the device
        and those being copied there (under the guard)."""
        s = self.settings
        reserved_bytes = sum(self._reserved.values())
        over_bytes = -1 if s.device_bytes is None else self._device.total + reserved_bytes + nbytes - s.device_bytes
        over_count = -1 if s.device_adapters is None else len(self._device) + len(self._reserved) + 1 - s.device_adapters
        return over_bytes, over_count

    def _fits_now(self, nbytes: int) -> bool:
        return max(self._over(nbytes)) <= 0

    def _fits(self, nbytes: int) -> bool:
        with self._guard:
            return self._fits_now(nbytes)

    def _keep_on_host(self, fingerprint: Fingerprint, host: HostHalves) -> None:
        """Keep `host` for the next promotion, within the host budget (only with tiers: without, nothing
        leaves the device)."""
        budget = self.settings.host_bytes
        if not self.settings.is_tiered or budget == 0:
            return
        nbytes = host_nbytes(host)
        self._host.put(fingerprint, pinned(host) if self.config.torch_device.type == "cuda" else host, nbytes)
        if budget is not None:
            self.stats.evictions["host"] += len(self._host.trim(budget))

    def _touch_disk(self, fingerprint: Fingerprint) -> None:
        """This node holds a copy now: the disk tier's budget drops the least recently used others."""
        if self.store is None or self.store.is_local or not self.settings.is_tiered:
            return
        try:
            self._disk.put(fingerprint, None, self.store.path(fingerprint).stat().st_size)
        except FileNotFoundError:
            return
        if self.settings.disk_bytes is not None:
            for other in self._disk.trim(self.settings.disk_bytes, keep={fingerprint, *self._loading}):
                self.store.drop_copy(other)
                self.stats.evictions["disk"] += 1

    # dropping what is no longer wanted

    async def reap(self) -> None:
        """Drop the unwanted adapters no request uses any more (past their grace period)."""
        async with self._lock:
            now = self.clock()
            due = [fp for fp, since in self.draining.items() if now - since >= DRAIN_GRACE_S and fp not in self._loading]
            if not due:
                return

            def drop(engine: Engine) -> list[Fingerprint]:
                with self._guard:
                    busy = engine.adapter_slots_in_use() | self.loop.pending_adapter_slots()
                    dropped = []
                    for fingerprint in due:
                        slot = self._device.get(fingerprint)
                        if slot is not None and (slot in busy or self._leased.get(fingerprint)):
                            continue
                        if slot is not None:
                            engine.runner.remove_adapter(self._device.pop(fingerprint))
                        dropped.append(fingerprint)
                    return dropped

            for fingerprint in await asyncio.wrap_future(self.loop.call(drop)):
                del self.known[fingerprint], self.draining[fingerprint]
                self.nbytes.pop(fingerprint, None)
                self._host.pop(fingerprint)
                if fingerprint in self._disk:
                    self._disk.pop(fingerprint)
                    self.store.drop_copy(fingerprint)
            self._reap_later()  # some may still run: look again later

    def _reap_later(self) -> None:
        if self.draining:
            asyncio.get_running_loop().call_later(DRAIN_GRACE_S, lambda: asyncio.ensure_future(self.reap()))

