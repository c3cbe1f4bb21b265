"""The device tier: the adapters in the runner's slots, least recently used first with their device
bytes; the room reserved for copies under way to it; the leases that keep a request's adapters there.

The event loop and the engine's thread both read and change it: every method takes `guard`. Room is
reserved before a copy starts, so the adapters here and those being copied here never pass the budget
together, however many come up at once. The deploy-time adapters (the operator's pins, `hot`) never
leave.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Final

from cache.lru import LRUBytes
from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import ResidencySettings
from worker.residency.eviction import choose_victims, over_budget
from worker.residency.stats import ResidencyStats

ON_DEVICE: Final = -1  # what `reserve` answers for an adapter already here (reservations count up from 0)


@dataclass(frozen=True)
class Evictor:
    """What eviction needs of the engine, on its thread between steps: the slots that running, waiting
    and arriving requests use, and how a slot is freed."""

    slots_in_use: Callable[[], Collection[AdapterSlot]]
    remove: Callable[[AdapterSlot], None]


class DeviceTier:
    def __init__(self, settings: ResidencySettings, stats: ResidencyStats,
                 pins: Iterable[tuple[Fingerprint, AdapterSlot, int]]) -> None:
        """`pins`: (fingerprint, slot, device bytes) of the adapters in the runner's slots when built."""
        self.settings, self.stats = settings, stats
        self.guard = threading.Lock()
        self.slots: LRUBytes[Fingerprint, AdapterSlot] = LRUBytes()
        self.leased: dict[Fingerprint, int] = {}  # leases held on each (only those with one)
        self.reserved: dict[int, int] = {}  # reservation -> the device bytes of a copy under way, counted before it starts
        self._reservation_ids = itertools.count()
        for fingerprint, slot, nbytes in pins:
            self.slots.put(fingerprint, slot, nbytes)
        self.hot = frozenset(self.slots)  # never evicted

    def __contains__(self, fingerprint: object) -> bool:
        with self.guard:
            return fingerprint in self.slots

    def listed(self) -> list[Fingerprint]:
        """The adapters here, least recently used first."""
        with self.guard:
            return list(self.slots)

    def resident(self) -> tuple[int, int]:
        """(adapters, bytes) here."""
        with self.guard:
            return len(self.slots), self.slots.num_bytes

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit beside the adapters here and the copies under way, evicting nothing."""
        with self.guard:
            return self._fits(nbytes)

    # leases

    def lease(self, fingerprint: Fingerprint) -> AdapterSlot | None:
        """Its slot, made the most recently used and kept from eviction until `unlease`; None when it is not here."""
        with self.guard:
            slot = self.slots.get(fingerprint)
            if slot is not None:
                self.leased[fingerprint] = self.leased.get(fingerprint, 0) + 1
            return slot

    def unlease(self, fingerprints: Iterable[Fingerprint]) -> None:
        with self.guard:
            for fingerprint in fingerprints:
                left = self.leased.get(fingerprint, 0) - 1
                if left > 0:
                    self.leased[fingerprint] = left
                else:
                    self.leased.pop(fingerprint, None)

    # room for a copy, and the copy installed

    def reserve(self, fingerprint: Fingerprint, nbytes: int, evictor: Evictor | None = None) -> int | None:
        """Room for `nbytes` more, taken for `fingerprint`'s copy: the reservation; ON_DEVICE when it is
        here already; None when there is no room. With `evictor` (the engine's thread, between steps),
        room is made by evicting the least recently used adapters no request uses."""
        with self.guard:
            if fingerprint in self.slots:
                return ON_DEVICE
            if not self._fits(nbytes):
                victims = None if evictor is None else self._victims(nbytes, evictor)
                if victims is None:
                    return None
                held_bytes = self.slots.num_bytes
                for victim in victims:
                    evictor.remove(self.slots.pop(victim))
                self.stats.evictions["device"] += len(victims)
                self.stats.evicted_bytes["device"] += held_bytes - self.slots.num_bytes
            reservation = next(self._reservation_ids)
            self.reserved[reservation] = nbytes
            return reservation

    def fill(self, reservation: int, fingerprint: Fingerprint, nbytes: int, add: Callable[[], AdapterSlot]) -> None:
        """The engine's thread, between steps: the room reserved becomes `fingerprint`'s, in the slot `add`
        puts it in; nothing when the reservation was given back or it is here already."""
        with self.guard:
            if self.reserved.pop(reservation, None) is not None and fingerprint not in self.slots:
                self.slots.put(fingerprint, add(), nbytes)

    def release(self, reservation: int) -> None:
        """Give the room back (a copy that failed; a no-op once it was filled)."""
        with self.guard:
            self.reserved.pop(reservation, None)

    def drop_unused(self, fingerprints: Iterable[Fingerprint], evictor: Evictor) -> list[Fingerprint]:
        """The engine's thread, between steps: free the slots of those of `fingerprints` that no request
        uses or holds a lease on; those dropped (the ones not here among them)."""
        with self.guard:
            in_use, held_bytes = evictor.slots_in_use(), self.slots.num_bytes
            dropped = []
            for fingerprint in fingerprints:
                slot = self.slots.peek(fingerprint)
                if slot is not None and (slot in in_use or self.leased.get(fingerprint)):
                    continue
                if slot is not None:
                    evictor.remove(self.slots.pop(fingerprint))
                dropped.append(fingerprint)
            self.stats.evicted_bytes["device"] += held_bytes - self.slots.num_bytes
            return dropped

    # under the guard

    def _over(self, nbytes: int) -> tuple[int, int]:
        return over_budget(self.settings, self.slots.num_bytes + sum(self.reserved.values()),
                           len(self.slots) + len(self.reserved), nbytes)

    def _fits(self, nbytes: int) -> bool:
        return max(self._over(nbytes)) <= 0

    def _victims(self, nbytes: int, evictor: Evictor) -> list[Fingerprint] | None:
        return choose_victims(self.slots.items(), self._over(nbytes), {*self.hot, *self.leased}, evictor.slots_in_use())


class Lease:
    """The device slots of one request's adapters, kept from eviction until `release` (once the
    request is in the engine's hands, which keeps them itself)."""

    def __init__(self, device: DeviceTier) -> None:
        self.device = device
        self.slots: dict[Fingerprint, AdapterSlot] = {}
        self.waited_s = 0.0  # how long it waited for adapters to come up

    def release(self) -> None:
        self.device.unlease(self.slots)
        self.slots = {}
