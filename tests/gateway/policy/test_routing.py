"""Routing as pure functions over a snapshot (no cluster)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from gateway.policy.routing import (
    DEVICE,
    HOST,
    LOWER,
    NoCandidateError,
    RecentLoad,
    ReplicasBusy,
    ReplicaView,
    RoutingSettings,
    affinity_key,
    candidates,
    choose,
)


def replicas(loads: dict[str, int] | None = None) -> list[ReplicaView]:
    layout = {"a-0": {"x", "y"}, "a-1": {"x", "y"}, "b-0": {"y", "z"}, "c-0": set()}
    loads = loads or {}
    return [ReplicaView(rid, rid.split("-")[0], frozenset(ads), loads.get(rid, 0)) for rid, ads in layout.items()]


def test_candidates_hold_every_adapter_and_are_healthy() -> None:
    assert [r.replica_id for r in candidates(replicas(), {"x"})] == ["a-0", "a-1"]
    assert [r.replica_id for r in candidates(replicas(), {"y", "z"})] == ["b-0"]
    assert len(candidates(replicas(), set())) == 4  # the base model runs anywhere
    with pytest.raises(NoCandidateError, match="no shard holds all of the adapters x, z together"):
        candidates(replicas(), {"x", "z"})
    with pytest.raises(NoCandidateError, match="adapters my-x, z together"):  # the tenant's names, where known
        candidates(replicas(), {"x", "z"}, names={"x": "my-x"})
    down = [r if r.replica_id != "b-0" else ReplicaView("b-0", "b", r.fingerprints, 0, is_healthy=False)
            for r in replicas()]
    assert [r.replica_id for r in candidates(down, {"z"})] == ["b-0"]  # failed lately, yet reachable: all there is
    assert [r.replica_id for r in candidates(down, set())] == ["a-0", "a-1", "c-0"]  # the healthy ones only
    gone = [replace(r, is_reachable=False) if r.replica_id == "b-0" else r for r in down]
    with pytest.raises(NoCandidateError, match="no healthy replica for adapters z: all 1 are down"):
        candidates(gone, {"z"})
    assert [r.replica_id for r in candidates(replicas(), {"x"}, exclude={"a-0"})] == ["a-1"]
    full = [ReplicaView(r.replica_id, r.shard, r.fingerprints, 2, num_seq_slots=1, capacity=2) for r in replicas()]
    with pytest.raises(ReplicasBusy, match="every replica for adapters z is full"):
        candidates(full, {"z"})


def test_affinity_is_sticky_per_prefix_and_adapter_set() -> None:
    pool = candidates(replicas(), {"y"})
    key = affinity_key("set-1", list(range(40)), 32)
    assert len({choose(pool, key).replica_id for _ in range(10)}) == 1
    assert affinity_key("set-1", list(range(32)) + [999], 32) == key  # only the first chunk counts
    assert affinity_key("set-2", list(range(40)), 32) != key
    spread = Counter(choose(pool, affinity_key("s", [i] * 32, 32)).replica_id for i in range(300))
    assert set(spread) == {"a-0", "a-1", "b-0"} and min(spread.values()) > 60  # different prefixes spread out


def test_affinity_yields_to_bounded_load() -> None:
    key = affinity_key("set", [1, 2, 3], 32)
    pool = candidates(replicas(), {"x"})
    favourite = choose(pool, key).replica_id
    other = "a-1" if favourite == "a-0" else "a-0"
    loaded = candidates(replicas({favourite: 3, other: 0}), {"x"})
    assert choose(loaded, key, RoutingSettings(eps=0.25)).replica_id == other  # 4 > ceil(1.25 * 4 / 2)
    assert choose(loaded, key, RoutingSettings(eps=10)).replica_id == favourite
    # with everyone placed by the policy, no replica exceeds (1 + eps) x the mean
    load = {"a-0": 0, "a-1": 0}
    for i in range(200):
        view = candidates(replicas(load), {"x"})
        load[choose(view, affinity_key("hot", [7], 32), RoutingSettings(eps=0.25)).replica_id] += 1
    assert max(load.values()) <= 1.25 * sum(load.values()) / 2 + 1


def test_random_and_least_loaded() -> None:
    pool = candidates(replicas({"a-0": 5, "a-1": 1}), {"x"})
    assert choose(pool, b"k", RoutingSettings(policy="least_loaded")).replica_id == "a-1"
    rng = random.Random(0)
    seen = Counter(choose(pool, b"k", RoutingSettings(policy="random"), rng=rng).replica_id for _ in range(100))
    assert set(seen) == {"a-0", "a-1"}
    with pytest.raises(ValueError, match="unknown routing policy"):
        RoutingSettings(policy="fastest")


def test_light_traffic_stays_balanced_through_recent_load() -> None:
    """One request at a time (nothing else in flight): a hot prefix still spreads once its
    replica has had more than its share lately."""
    recent, now, counts = RecentLoad(half_life_s=30), 0.0, Counter()
    hot = affinity_key("set", [1] * 32, 32)
    for i in range(400):
        now += 1.0
        key = hot if i % 3 else affinity_key("set", [i] * 32, 32)  # two thirds of the traffic is one prefix
        view = [ReplicaView(r, "a", frozenset({"x"}), 0, True, recent.get(r, now)) for r in ("r0", "r1", "r2", "r3")]
        chosen = choose(view, key, RoutingSettings(eps=0.25)).replica_id
        recent.add(chosen, now)
        counts[chosen] += 1
    assert max(counts.values()) / (sum(counts.values()) / 4) <= 1.3
    assert recent.get("r0", now + 30) == pytest.approx(recent.get("r0", now) / 2)


def test_recent_load_decays_by_its_half_life_over_a_long_run() -> None:
    """The counts are kept scaled to one moment and rescaled past RecentLoad.REBASE half-lives:
    reads stay the decayed counts however long the gateway runs."""
    recent, now = RecentLoad(half_life_s=10), 5.0
    recent.add("r0", now)
    recent.add("r0", now)
    recent.add("r1", now + 10)
    assert recent.get("r0", now + 10) == pytest.approx(1.0) and recent.get("r1", now + 10) == pytest.approx(1.0)
    assert recent.get_many(["r1", "r0", "r9"], now + 20) == pytest.approx([0.5, 0.5, 0.0])
    for step in range(1, 4000):  # 40,000 s: 4,000 half-lives, past REBASE many times
        recent.add("r2", now + 10 * step)
    assert recent.get("r2", now + 40_000) == pytest.approx(sum(0.5 ** k for k in range(1, 4000)))
    assert recent.get("r0", now + 40_000) == 0.0
    recent.add("r0", now + 40_000)
    assert recent.get("r0", now + 40_010) == pytest.approx(0.5)


def test_ranks_are_the_same_for_large_pools() -> None:
    """Pools of _VECTOR_FROM replicas or more are ranked with numpy: the same choice as one by one."""
    from gateway.policy.routing import rendezvous as routing

    pool = [ReplicaView(f"replica-{i}", "a", frozenset()) for i in range(routing._VECTOR_FROM + 7)]
    rng = random.Random(3)
    for _ in range(50):
        key_hash = rng.getrandbits(64)
        assert routing._ranks(key_hash, pool) == [routing._rank(key_hash, r.replica_id) for r in pool]


def test_affinity_does_not_queue_behind_its_favourite_while_another_replica_is_idle() -> None:
    key = affinity_key("set", [5] * 32, 32)
    idle = [ReplicaView(r, "a", frozenset({"x"}), 0, True, 0.0) for r in ("r0", "r1", "r2", "r3")]
    favourite = choose(idle, key).replica_id
    # the favourite has one request running and was sent less than the others lately:
    # by load alone it would still take this one and make it wait
    busy = [ReplicaView(r.replica_id, "a", r.fingerprints, 1 if r.replica_id == favourite else 0, True,
                        0.0 if r.replica_id == favourite else 3.0) for r in idle]
    chosen = choose(busy, key)
    assert chosen.replica_id != favourite and chosen.in_flight == 0
    # without a shared cache tier the prefix's KV is only on the favourite: waiting beats recomputing
    assert choose(busy, key, shared_cache=False).replica_id == favourite
    # once everyone is busy, the favourite is as good as any and takes it again
    all_busy = [ReplicaView(r.replica_id, "a", r.fingerprints, 1, True, 0.0) for r in idle]
    assert choose(all_busy, key).replica_id == favourite


def test_affinity_prefers_the_replica_with_the_adapter_nearest_and_still_bounds_load() -> None:
    """Four replicas of a shard serve adapter x: one has it on its device, one on its host, two lower
    (disk or the store). Requests go nearest first whatever their prefix, while load stays bounded."""
    tiers = {"r-0": {"x": HOST}, "r-1": {}, "r-2": {"x": DEVICE}, "r-3": {}}

    def pool(load: dict[str, int]) -> list[ReplicaView]:
        return [ReplicaView(rid, "r", frozenset({"x"}), load.get(rid, 0), tiers=t) for rid, t in tiers.items()]

    keys = [affinity_key("s", [i] * 32, 32) for i in range(50)]
    assert {choose(pool({}), key, fingerprints={"x"}).replica_id for key in keys} == {"r-2"}
    assert {choose(pool({"r-2": 3}), key, fingerprints={"x"}).replica_id for key in keys} == {"r-0"}  # the next nearest
    assert len({choose(pool({}), key).replica_id for key in keys}) > 1  # the base model: by prefix, as before
    assert ReplicaView("a", "r", frozenset({"x", "y"}), tiers={"x": DEVICE}).tier({"x", "y"}) == LOWER  # the furthest counts
    assert ReplicaView("a", "r", frozenset({"x"})).tier({"x"}) == DEVICE  # a worker without tiers keeps all on its device
    load = dict.fromkeys(tiers, 0)
    for key in keys * 4:  # everyone placed by the policy: the device replica takes most, none past the bound
        load[choose(pool(load), key, RoutingSettings(eps=0.25), fingerprints={"x"}).replica_id] += 1
    assert load["r-2"] == max(load.values()) and max(load.values()) <= 1.25 * sum(load.values()) / 4 + 1
