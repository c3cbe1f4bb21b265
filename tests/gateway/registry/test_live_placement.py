"""The registry's placement over the replicas that serve now: an autoscaled shard counts the
replicas Serve runs (its config's `replicas` is only its maximum), a shard asleep takes no new
copy, and a new adapter whose shards all sleep wakes them before it must be loaded."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from cache.blobs import open_blob_store
from gateway.catalog import Catalog
from gateway.cluster.membership import ASLEEP, UP
from gateway.cluster.pool import replica_infos
from gateway.registry.records import SHARED, AdapterRecord, FileRecords, record_key
from gateway.registry.registry import AdapterRegistry
from tests.gateway.gateway_setup import tiny_config

SHARDS = [{"name": "hot", "adapters": ["a"], "autoscaling": {"min_replicas": 0, "max_replicas": 3}},
          {"name": "warm", "adapters": ["b"]}, {"name": "cool", "adapters": ["alo", "alo2"]}]
X, Y, Z = "x" * 64, "y" * 64, "z" * 64  # registered adapters' fingerprints: x on the autoscaled shard


def registry_with(tiny_llama, tmp_path, up: dict[str, bool], woken: list[list[str]] | None = None) -> AdapterRegistry:
    tmp_path.mkdir(exist_ok=True)
    config = tiny_config(tiny_llama, tmp_path, "unused", shards=SHARDS)
    records = FileRecords(tmp_path, "placing")

    def wake(replica_ids: list[str]) -> float:
        woken.append(sorted(replica_ids))
        return 30.0

    registry = AdapterRegistry(config, Catalog(config), records, open_blob_store(config.blob_store()),
                               replica_infos(config), phase=lambda replica_id: UP if up.get(replica_id, True) else ASLEEP,
                               wake=None if woken is None else wake)

    made = [AdapterRecord(SHARED, name, fp, 1, 4, ("attn_q",), shards=(shard,))
            for name, fp, shard in (("x", X, "hot"), ("y", Y, "warm"), ("z", Z, "cool"))]
    asyncio.run(_seeded(registry, {r.key: r for r in made}))
    registry.traffic = {X: 60.0, Y: 20.0, Z: 20.0}
    return registry


async def _seeded(registry: AdapterRegistry, made: dict[str, AdapterRecord]) -> None:
    await registry.records.transact(lambda records: (made, None))
    await registry.refresh(force=True)


def test_a_hot_adapters_shard_scaled_up_holds_its_copies_and_scaled_down_it_gets_one_elsewhere(tiny_llama, tmp_path) -> None:
    three_up = registry_with(tiny_llama, tmp_path / "3", {})
    assert three_up.placement.num_replicas_now() == {"hot": 3, "warm": 1, "cool": 1}
    assert asyncio.run(three_up.replan()) == {}  # 60% of the traffic on 3 of 5 replicas: its share
    one_up = registry_with(tiny_llama, tmp_path / "1", {"hot-1": False, "hot-2": False})
    assert one_up.placement.num_replicas_now()["hot"] == 1
    changes = asyncio.run(one_up.replan())  # the same traffic on 1 of 3: a copy on another shard
    assert changes[X][0] == "hot" and changes[X][1] in ("warm", "cool") and len(changes[X]) == 2
    assert one_up.current[record_key(SHARED, "x")].shards == changes[X]


def test_an_adapter_asked_for_while_its_shard_sleeps_gets_a_copy_on_one_that_serves(tiny_llama, tmp_path) -> None:
    asleep = registry_with(tiny_llama, tmp_path, dict.fromkeys(("hot-0", "hot-1", "hot-2"), False))
    asleep.traffic = {X: 1.0, Y: 50.0, Z: 50.0}  # one request: a copy where a replica serves spares its cold starts
    changes = asyncio.run(asleep.replan())
    assert list(changes) == [X] and changes[X][0] == "hot" and changes[X][1] in ("warm", "cool")
    asleep.traffic = {Y: 90.0, Z: 10.0}  # y's share asks for a copy: on cool, the one other shard with replicas
    assert asyncio.run(asleep.replan())[Y] == ("warm", "cool")  # a shard asleep is given none


def test_a_new_adapter_goes_where_replicas_serve_and_wakes_its_shards_when_all_sleep(tiny_llama, tmp_path) -> None:
    up = dict.fromkeys(("hot-0", "hot-1", "hot-2"), False)
    woken: list[list[str]] = []
    registry = registry_with(tiny_llama, tmp_path, up, woken)
    # hot pins the fewest (its config's one and x) but sleeps: the new adapter goes to warm and cool
    assert registry.placement.for_new({"hot": 2, "warm": 2, "cool": 3}) == ("warm", "cool")
    asyncio.run(registry._until_loaded(Y, ("warm",)))
    assert woken == []  # warm serves: nothing to wake
    asyncio.run(registry._until_loaded(X, ("hot",)))
    assert woken == [["hot-0", "hot-1", "hot-2"]]


def test_an_adapter_gives_its_extra_copies_back_after_three_re_plans_without_a_request(tiny_llama, tmp_path) -> None:
    registry = registry_with(tiny_llama, tmp_path, {})
    key = record_key(SHARED, "x")
    spread = {key: replace(registry.current[key], shards=("hot", "warm", "cool"))}
    asyncio.run(_seeded(registry, spread))
    registry.count([X] * 5)  # asked for once more, then not at all
    kept = []
    for _ in range(4):
        registry.traffic.update({Y: 20.0, Z: 20.0})
        asyncio.run(registry.replan())
        kept.append(len(registry.current[key].shards))
    assert kept == [3, 3, 3, 2]  # three re-plans without a request, then back to registry.copies (2)
