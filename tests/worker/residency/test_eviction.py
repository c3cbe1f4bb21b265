"""Which adapters leave the device for room (worker/residency/eviction.py): pure, on plain data."""

from __future__ import annotations

from worker.contract.identity import AdapterSlot, Fingerprint
from worker.contract.spec import ResidencySettings
from worker.residency.eviction import choose_victims, over_budget

RESIDENTS = [(Fingerprint(name), AdapterSlot(slot), 100) for slot, name in enumerate("abcd")]  # least recently used first


def test_over_budget_counts_both_budgets_and_ignores_an_unset_one() -> None:
    assert over_budget(ResidencySettings(device_adapters=4), 400, 4, 100) == (-1, 1)
    assert over_budget(ResidencySettings(device_bytes=450), 400, 4, 100) == (50, -1)
    assert over_budget(ResidencySettings(device_adapters=5, device_bytes=500), 400, 4, 100) == (0, 0)  # fits exactly


def test_the_least_recently_used_go_first_and_no_more_than_the_room_needs() -> None:
    assert choose_victims(RESIDENTS, (150, -1), kept=(), slots_in_use=()) == ["a", "b"]
    assert choose_victims(RESIDENTS, (0, 0), kept=(), slots_in_use=()) == []


def test_kept_adapters_and_slots_in_use_are_skipped() -> None:
    assert choose_victims(RESIDENTS, (-1, 1), kept={Fingerprint("a")}, slots_in_use={AdapterSlot(1)}) == ["c"]
    assert choose_victims(RESIDENTS, (-1, 2), kept={Fingerprint("a"), Fingerprint("b")}, slots_in_use={AdapterSlot(2)}) is None
