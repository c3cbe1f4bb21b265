"""Which adapters leave the device to make room (pure, over plain data): the least recently used
ones that nothing holds, and no more of them than the room needs."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import ResidencySettings


def over_budget(settings: ResidencySettings, resident_bytes: int, num_resident: int, nbytes: int) -> tuple[int, int]:
    """(bytes, adapters) past the device's budgets once one more adapter of `nbytes` is there beside
    `num_resident` adapters of `resident_bytes` (those on the device and those being copied there).
    -1 for a budget that is not set; zero or less: it fits."""
    over_bytes = -1 if settings.device_bytes is None else resident_bytes + nbytes - settings.device_bytes
    over_count = -1 if settings.device_adapters is None else num_resident + 1 - settings.device_adapters
    return over_bytes, over_count


def choose_victims(residents: Iterable[tuple[Fingerprint, AdapterSlot, int]], over: tuple[int, int],
                   kept: Collection[Fingerprint], slots_in_use: Collection[AdapterSlot]) -> list[Fingerprint] | None:
    """The adapters to evict so that `over` (over_budget's bytes and adapters) is made up: from
    `residents` (fingerprint, slot, bytes; least recently used first), skipping those `kept` (the pins,
    the leased) and those whose slot a request uses. None when the others cannot make the room."""
    over_bytes, over_count = over
    victims = []
    for fingerprint, slot, nbytes in residents:
        if over_bytes <= 0 and over_count <= 0:
            break
        if fingerprint in kept or slot in slots_in_use:
            continue
        victims.append(fingerprint)
        over_bytes -= nbytes
        over_count -= 1
    return victims if over_bytes <= 0 and over_count <= 0 else None
