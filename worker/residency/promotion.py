"""Bringing an adapter up to the device while its requests wait, their deadlines counting, and every
other request keeps stepping: read off the step loop (a thread), room on the device reserved for it,
copied there off the step loop (worker/lora/attach.py: `device_halves`, on a GPU on a side stream),
then put in a slot between two steps, which only wires it in. Room is made by evicting the least
recently used adapters that no running, waiting or arriving request uses; when every one there is in
use, the promotion waits for one to be free, until the request's deadline (then Overloaded: 503)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from worker.contract.identity import Fingerprint
from worker.engine.engine import Engine
from worker.engine.loop import EngineLoop, Overloaded
from worker.formats.adapter import LoRAAdapter
from worker.lora.attach import HostHalves, device_halves
from worker.residency.device import ON_DEVICE, DeviceTier, Evictor
from worker.residency.disk import DiskTier
from worker.residency.host import HostTier
from worker.residency.memory import HostMemory
from worker.residency.stats import ResidencyStats

ROOM_POLL_S = 0.01  # how often a promotion that found every adapter on the device in use looks again
Read = Callable[[], tuple[LoRAAdapter, HostHalves | None]]  # an adapter and its host halves from this node's copy (a thread)


def evictor_of(engine: Engine, loop: EngineLoop) -> Evictor:
    """Eviction on the engine's thread, between steps: the slots its requests and those submitted to it
    use are kept; a slot is freed by the runner."""
    return Evictor(lambda: engine.adapter_slots_in_use() | loop.pending_adapter_slots(), engine.runner.remove_adapter)


class Promotions:
    """The adapters on their way to the device: one promotion each, however many requests wait for it."""

    def __init__(self, loop: EngineLoop, device: DeviceTier, host: HostTier, disk: DiskTier, stats: ResidencyStats,
                 tier_of: Callable[[Fingerprint], str], clock: Callable[[], float], memory: HostMemory) -> None:
        """`tier_of`: where an adapter is now (the tier a promotion is counted from); `memory`: the
        threads reads and copies run on, and the trim after evictions (memory.py)."""
        self.loop, self.device, self.host, self.disk, self.stats = loop, device, host, disk, stats
        self.tier_of, self.clock, self.memory = tier_of, clock, memory
        self.config = loop.engine.runner.config
        self.loading: dict[Fingerprint, asyncio.Future] = {}  # promotions under way

    async def come_up(self, fingerprint: Fingerprint, adapter: LoRAAdapter, nbytes: int, read: Read, until: float) -> None:
        """Bring `fingerprint` (`adapter`, `nbytes` on the device) onto the device, or wait for the
        promotion already under way. `read` is how it is read when the host tier does not have it."""
        task = self.loading.get(fingerprint)
        if task is None:
            task = self.loading[fingerprint] = asyncio.ensure_future(self._promote(fingerprint, adapter, nbytes, read, until))
            task.add_done_callback(lambda done: self.loading.pop(fingerprint, None) if self.loading.get(fingerprint) is done else None)
        await asyncio.shield(task)

    async def _promote(self, fingerprint: Fingerprint, adapter: LoRAAdapter, nbytes: int, read: Read, until: float) -> None:
        started, source = self.clock(), self.tier_of(fingerprint)
        host = self.host.get(fingerprint)
        if host is None:
            try:
                _, host = await self.memory.run(read)
            except Exception as e:
                raise Overloaded(f"adapter {fingerprint[:16]} could not be loaded: {str(e)[:200]}") from e
            self.disk.touch(fingerprint, keep=self.loading)
            self.host.keep(fingerprint, host)
        await self.install(fingerprint, adapter, nbytes, host, may_evict=True, until=until)
        self.stats.promoted(source, self.clock() - started)
        await self.settle_memory()

    def evicted_host_bytes(self) -> int:
        """The bytes of adapters that have left a tier in host memory: the host's, and a CPU's device."""
        on_host = self.config.torch_device.type == "cpu"
        return self.stats.evicted_bytes["host"] + (self.stats.evicted_bytes["device"] if on_host else 0)

    async def settle_memory(self) -> None:
        """Hand what evictions freed back to the OS once enough was (a reader: a trim takes ~ms)."""
        await self.memory.run(self.memory.settle, self.evicted_host_bytes())

    async def install(self, fingerprint: Fingerprint, adapter: LoRAAdapter, nbytes: int, host: HostHalves,
                      may_evict: bool, until: float | None = None) -> None:
        """Reserve room on the device (`_reserve`), copy `host` into it (a thread), then take a slot between
        steps. Shielded: once begun it runs to its end, so no reservation or copy is left behind by a caller
        that is cancelled."""
        copy = self._reserve_copy_install(fingerprint, adapter, nbytes, host, may_evict, until)
        await asyncio.shield(asyncio.ensure_future(copy))

    async def _reserve_copy_install(self, fingerprint: Fingerprint, adapter: LoRAAdapter, nbytes: int, host: HostHalves,
                                    may_evict: bool, until: float | None) -> None:
        reservation = await self._reserve(fingerprint, nbytes, may_evict, until)
        if reservation is None:
            return  # on the device already, or (without `may_evict`) no room: it stays lower down
        try:
            halves = await self.memory.run(device_halves, host, self.config)

            def install(engine: Engine) -> None:  # the engine's thread, between steps
                self.device.fill(reservation, fingerprint, nbytes, lambda: engine.runner.add_adapter(adapter, device=halves))

            await asyncio.wrap_future(self.loop.call(install))
        finally:  # failed: the room is free again (installed: it is already)
            self.device.release(reservation)

    async def _reserve(self, fingerprint: Fingerprint, nbytes: int, may_evict: bool, until: float | None) -> int | None:
        """Room on the device for `nbytes` more, taken for `fingerprint`'s copy (the reservation): free room
        at once; else, with `may_evict`, room made between steps by evicting, and while every adapter there
        is in use, waited for (Overloaded past `until`). None when it is on the device already, or when there
        is no room and `may_evict` is not set."""

        def evicting(engine: Engine) -> int | None:  # the engine's thread, between steps
            return self.device.reserve(fingerprint, nbytes, evictor_of(engine, self.loop))

        while True:
            reservation = self.device.reserve(fingerprint, nbytes)
            if reservation == ON_DEVICE:
                return None
            if reservation is not None or not may_evict:
                return reservation
            reservation = await asyncio.wrap_future(self.loop.call(evicting))
            if reservation == ON_DEVICE:
                return None
            if reservation is not None:
                return reservation
            if self.clock() >= until and fingerprint not in self.device:
                raise Overloaded(f"no room on the device for adapter {fingerprint[:16]}: every adapter there is in use")
            await asyncio.sleep(ROOM_POLL_S)
