"""Adapter tiers on a shard replica (worker/residency/), on a tiny model: a device tier
smaller than what the replica serves, a host tier, and this node's disk copies of a store
elsewhere (a file:// store, so its copies can be dropped); the device's budget counts the
copies under way to it, and a DoRA's magnitudes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest

from cache.blobs import BlobStoreConfig
from cache.prefix import PrefixCacheConfig
from tests.helpers import TEST_DEVICE, deltas_of
from tests.tinymodels import random_lora, write_adapter
from worker.contract.calls import WorkerCall
from worker.contract.params import SamplingParams
from worker.contract.spec import DeviceSettings, EngineConfig, ResidencySettings, WorkerSpec
from worker.formats.adapter import load_adapter
from worker.formats.gguf_file import GGUFFile
from worker.residency import promotion
from worker.shard import ShardWorker

TARGETS = ["blk.0.attn_q.weight", "blk.1.attn_v.weight", "blk.0.ffn_up.weight"]


@pytest.fixture(scope="module")
def stored(tiny_llama, tmp_path_factory):
    """Six adapters in a store (file://), their fingerprints in order."""
    from cache.blobs import open_blob_store

    directory = tmp_path_factory.mktemp("tiers")
    store = open_blob_store(BlobStoreConfig(url=(directory / "store").as_uri(), cache_dir=str(directory / "upload")))
    base, fingerprints = GGUFFile(tiny_llama.path), []
    for i in range(6):
        path = write_adapter(directory / f"a{i}.gguf", random_lora(tiny_llama, TARGETS, 4, seed=20 + i, std=0.5))
        fingerprint = load_adapter(path, base).fingerprint
        store.put(path, fingerprint)
        fingerprints.append(fingerprint)
    return directory, fingerprints


def tiered_worker(tiny_llama, directory, cache: str, residency: ResidencySettings, num_seq_slots: int = 4) -> ShardWorker:
    spec = WorkerSpec("s", str(tiny_llama.path), (), EngineConfig(num_seq_slots=num_seq_slots, slot_len=96, max_waiting=8),
                      DeviceSettings(device=TEST_DEVICE.device), PrefixCacheConfig(chunk_tokens=8, redis=None),
                      blob_store=BlobStoreConfig(url=(directory / "store").as_uri(), cache_dir=str(directory / cache)),
                      residency=residency)
    return ShardWorker(spec)


def call(i: int, fingerprint: str, max_tokens: int = 8) -> WorkerCall:
    return WorkerCall(f"r{i}-{random.random()}", (5, 6, 7, 9 + i % 5), SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                                    ignore_eos=True),
                      scales_by_fingerprint={fingerprint: 1.0}, cache_prompt=False)


def tokens(deltas) -> list[int]:
    assert deltas[-1].finish_reason == "length", deltas[-1].error
    return [t for d in deltas for t in d.token_ids]


def test_an_evicted_adapter_comes_back_with_the_same_tokens_and_the_device_holds_its_budget(tiny_llama, stored) -> None:
    directory, fingerprints = stored
    worker = tiered_worker(tiny_llama, directory, "evicted", ResidencySettings(device_adapters=2, host_bytes=0))
    try:
        async def scenario() -> None:
            state = await worker.sync(1, fingerprints[:4])
            assert state["held"] == sorted(fingerprints[:4]) and not state["failed"]
            assert len(state["tiers"]["device"]) == 2  # the first two fit; the others wait on disk
            first = [tokens(await deltas_of(worker, call(0, fp))) for fp in fingerprints[:4]]
            assert len({tuple(t) for t in first}) == 4  # four adapters, four answers
            again = [tokens(await deltas_of(worker, call(0, fp))) for fp in fingerprints[:4]]
            assert again == first  # each evicted and brought back in between: the same tokens
            residents = worker.residency.residents()
            assert residents["device"][0] == 2 and len(worker.runner.adapters) == 2
            stats = worker.residency.stats
            assert stats.evictions["device"] >= 4 and stats.promotions["disk"] >= 4 and stats.waited >= 4

        asyncio.run(scenario())
        metrics = worker.metrics()
        assert 'loraplex_worker_resident_adapters{tier="device"} 2' in metrics
        assert 'loraplex_worker_adapter_load_seconds_count{tier="disk"}' in metrics
        assert "loraplex_worker_requests_waited_on_load_total" in metrics
    finally:
        worker.close()


def test_eviction_never_takes_an_adapter_in_use_and_a_request_waits_for_room(tiny_llama, stored) -> None:
    """One device slot, a long request on it: a request for another adapter waits until it ends, and the
    long one's tokens are those it gets alone."""
    directory, fingerprints = stored
    worker = tiered_worker(tiny_llama, directory, "in-use", ResidencySettings(device_adapters=1))
    try:
        async def scenario() -> None:
            await worker.sync(1, fingerprints[:2])
            alone = tokens(await deltas_of(worker, call(1, fingerprints[0], max_tokens=40)))
            await deltas_of(worker, call(2, fingerprints[1]))  # the other one on the device now
            long = asyncio.ensure_future(deltas_of(worker, call(1, fingerprints[0], max_tokens=40)))
            while worker.loop.engine.counters.steps == 0 or not worker.runner.adapters or \
                    worker.residency.tier_of(fingerprints[0]) != "device":
                await asyncio.sleep(0.005)
            waiting = asyncio.ensure_future(deltas_of(worker, call(3, fingerprints[1])))
            long_tokens = tokens(await long)
            assert not waiting.done()  # it waited for the one slot's adapter to be free
            tokens(await waiting)
            assert long_tokens == alone and worker.residency.tier_of(fingerprints[1]) == "device"

        asyncio.run(scenario())
    finally:
        worker.close()


def test_a_promotion_does_not_hold_up_other_requests_steps(tiny_llama, stored, monkeypatch) -> None:
    """While an adapter is read (held up here until told), a request already running keeps stepping:
    it runs all its 40 steps before the read is let go."""
    directory, fingerprints = stored
    worker = tiered_worker(tiny_llama, directory, "overlap", ResidencySettings(device_adapters=4, host_bytes=0))
    try:
        release, reading = threading.Event(), threading.Event()
        original = worker.residency._read

        def slow_read(fingerprint):
            if fingerprint == fingerprints[5]:
                reading.set()
                assert release.wait(30)
            return original(fingerprint)

        async def scenario() -> None:
            await worker.sync(1, fingerprints[4:6])
            worker.residency.device.slots.pop(fingerprints[5])  # as if evicted: only on disk
            slot = next(s for s, a in worker.runner.adapters.items() if a.fingerprint == fingerprints[5])
            await asyncio.wrap_future(worker.loop.call(lambda engine: engine.runner.remove_adapter(slot)))
            monkeypatch.setattr(worker.residency, "_read", slow_read)
            running = asyncio.ensure_future(deltas_of(worker, call(4, fingerprints[4], max_tokens=40)))
            promoted = asyncio.ensure_future(deltas_of(worker, call(5, fingerprints[5])))
            await asyncio.to_thread(reading.wait, 30)
            steps_before = worker.loop.engine.counters.steps
            assert len(tokens(await running)) == 40  # every one of its steps ran while the read was held up
            assert worker.loop.engine.counters.steps - steps_before >= 30 and not promoted.done()
            release.set()
            tokens(await promoted)

        asyncio.run(scenario())
    finally:
        release.set()
        worker.close()


def test_budgets_hold_under_churn(tiny_llama, stored) -> None:
    directory, fingerprints = stored
    file_bytes = max((directory / f"a{i}.gguf").stat().st_size for i in range(6))
    host_budget = 2 * sum(a.nbytes + b.nbytes for a, b in random_lora(tiny_llama, TARGETS, 4, seed=20).values())  # two adapters
    worker = tiered_worker(tiny_llama, directory, "churn",
                           ResidencySettings(device_adapters=3, host_bytes=host_budget, disk_bytes=4 * file_bytes))
    try:
        async def scenario() -> int:
            await worker.sync(1, fingerprints)
            seen, rng = [], random.Random(7)
            expected = {}

            async def one(i: int) -> None:
                fp = rng.choice(fingerprints)
                got = tokens(await deltas_of(worker, call(0, fp, max_tokens=4)))
                assert expected.setdefault(fp, got) == got
                seen.append(worker.residency.residents())  # at every answer too: the watcher's samples depend on the loop

            async def watch() -> None:
                while True:
                    seen.append(worker.residency.residents())
                    copies = len(list((directory / "churn").glob("*.gguf")))
                    assert copies <= 4 + len(worker.residency.promotions.loading)  # a copy just fetched, until its promotion trims the tier
                    await asyncio.sleep(0.002)

            watcher = asyncio.ensure_future(watch())
            for start in range(0, 36, 3):
                await asyncio.gather(*(one(i) for i in range(start, start + 3)))
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher  # a check it failed fails the test
            for residents in seen:
                assert residents["device"][0] <= 3 and residents["host"][1] <= host_budget
                assert residents["disk"][1] <= 4 * file_bytes
            return len(seen)

        assert asyncio.run(scenario()) > 10
        stats = worker.residency.stats
        assert stats.evictions["device"] > 0 and stats.evictions["host"] > 0 and stats.evictions["disk"] > 0
    finally:
        worker.close()


def test_concurrent_promotions_never_pass_the_device_budget_with_their_copies(tiny_llama, stored, monkeypatch) -> None:
    """Room for two adapters, six requests at once, one per adapter, each copy to the device slowed so
    that they overlap: the bytes on the device and those being copied there never pass the budget."""
    from worker.lora.attach import host_halves

    directory, fingerprints = stored
    host = host_halves(load_adapter(directory / "a0.gguf", GGUFFile(tiny_llama.path)))
    adapter_bytes = sum((a.size + b.size) * TEST_DEVICE.torch_dtype.itemsize for a, b, _ in host.values())
    budget = 2 * adapter_bytes
    worker = tiered_worker(tiny_llama, directory, "concurrent", ResidencySettings(device_bytes=budget), num_seq_slots=6)
    lock, resident, in_copy, totals = threading.Lock(), {}, {}, []  # slot -> bytes; id(its halves) -> bytes
    copy, add, remove = promotion.device_halves, worker.runner.add_adapter, worker.runner.remove_adapter

    def counted() -> None:
        totals.append(sum(resident.values()) + sum(in_copy.values()))

    def slow_copy(host, config):  # a thread
        token = object()
        with lock:
            in_copy[id(token)] = adapter_bytes  # every adapter here has the same shapes
            counted()
        time.sleep(0.05)
        halves = copy(host, config)
        with lock:
            in_copy[id(halves)] = in_copy.pop(id(token))
        return halves

    def counted_add(adapter, host=None, device=None):  # the engine's thread
        with lock:
            in_copy.pop(id(device), None)
            slot = add(adapter, host, device)
            resident[slot] = worker.runner.lora.nbytes(slot)
            counted()
        return slot

    def counted_remove(slot):
        with lock:
            resident.pop(slot, None)
            remove(slot)

    monkeypatch.setattr(promotion, "device_halves", slow_copy)
    monkeypatch.setattr(worker.runner, "add_adapter", counted_add)
    monkeypatch.setattr(worker.runner, "remove_adapter", counted_remove)
    try:
        async def scenario() -> None:
            await worker.sync(1, fingerprints)
            for _ in range(2):
                answers = await asyncio.gather(*(deltas_of(worker, call(i, fp, max_tokens=4)) for i, fp in enumerate(fingerprints)))
                assert all(len(tokens(deltas)) == 4 for deltas in answers)

        asyncio.run(scenario())
        assert worker.residency.stats.promotions["host"] >= 8 and len(totals) >= 16
        assert max(totals) <= budget, (max(totals), budget)
        assert not worker.residency.device.reserved  # every reservation became a resident adapter or was given back
    finally:
        worker.close()


def test_host_halves_kept_as_tensors_reach_the_device_unchanged(tiny_llama, stored) -> None:
    """A GPU worker keeps its host tier as page-locked tensors (`pinned`); the copy to the device takes
    them as it takes arrays (here on the test device, unpinned: the path is the same)."""
    import torch

    from worker.lora.attach import device_halves, host_halves
    from worker.model.device import DeviceConfig

    directory, _ = stored
    host = host_halves(load_adapter(directory / "a1.gguf", GGUFFile(tiny_llama.path)))
    as_tensors = {t: (torch.from_numpy(a), torch.from_numpy(b), d) for t, (a, b, d) in host.items()}
    config = DeviceConfig(device=TEST_DEVICE.device)
    for (a, b, _), (a2, b2, _) in zip(device_halves(host, config).values(), device_halves(as_tensors, config).values()):
        assert torch.equal(a, a2) and torch.equal(b, b2) and a2.device.type == config.torch_device.type
