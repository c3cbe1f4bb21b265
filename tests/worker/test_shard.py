"""A shard replica's side of the wire contract: WorkerCall in, Deltas out, on a tiny model."""

from __future__ import annotations

import asyncio
import time

import pytest

from cache.blobs import BlobStoreConfig
from cache.prefix import PrefixCacheConfig
from tests.helpers import TEST_DEVICE, deltas_of
from tests.tinymodels import random_lora, write_adapter
from worker.contract.calls import WorkerCall
from worker.contract.params import SamplingParams
from worker.contract.spec import DeviceSettings, EngineConfig, WorkerSpec
from worker.shard import ShardWorker


@pytest.fixture(scope="module")
def worker(tiny_llama, tmp_path_factory):
    directory = tmp_path_factory.mktemp("shard")
    path = write_adapter(directory / "a.gguf", random_lora(tiny_llama, ["blk.0.attn_q.weight"], 4, seed=3))
    spec = WorkerSpec("s", str(tiny_llama.path), (str(path),), EngineConfig(num_seq_slots=2, slot_len=64, max_waiting=4),
                      DeviceSettings(device=TEST_DEVICE.device), PrefixCacheConfig(chunk_tokens=8),
                      blob_store=BlobStoreConfig(cache_dir=str(directory / "store")))
    shard = ShardWorker(spec)
    yield shard
    shard.close()


def call(i: int, max_tokens: int = 6, **kw) -> WorkerCall:
    return WorkerCall(f"r{i}", (5, 6, 7, i % 50 + 10), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), **kw)


async def collect(worker: ShardWorker, c: WorkerCall) -> list:
    return await deltas_of(worker, c)


def seed_fingerprint(worker: ShardWorker) -> str:
    """The deploy-time adapter's fingerprint (slot 0): how a call names it."""
    return worker.runner.adapters[0].fingerprint


def test_deltas_stream_back_without_an_executor_thread_per_waiting_request(worker, monkeypatch) -> None:
    threads = []
    original = asyncio.to_thread
    monkeypatch.setattr(asyncio, "to_thread", lambda f, *a, **k: threads.append(f) or original(f, *a, **k))

    async def run() -> list[list]:
        return await asyncio.gather(
            *(collect(worker, call(i, scales_by_fingerprint={seed_fingerprint(worker): 1.0} if i % 2 else {})) for i in range(6))
        )

    results = asyncio.run(run())  # 6 requests on 2 slots: 4 wait
    assert len(threads) == 6  # one hop per request (its submission, with the cache lookup), none per delta
    for deltas in results:
        assert [d.finish_reason for d in deltas][-1] == "length" and sum(len(d.token_ids) for d in deltas) == 6
        assert deltas[-1].usage.completion_tokens == 6 and deltas[-1].queue_time_s >= 0


def test_the_replica_reports_the_decode_thread_count_it_measured(worker) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    asyncio.run(collect(worker, call(1, max_tokens=20)))
    families = {f.name: f for f in text_string_to_metric_families(worker.metrics())}
    if worker.runner.max_threads is None:  # not on a CPU: nothing to measure
        assert "loraplex_worker_decode_threads" not in families
        return
    assert families["loraplex_worker_decode_threads"].samples[0].value == worker.loop.engine.threads.current
    assert 1 <= worker.loop.engine.threads.current <= worker.runner.max_threads
    assert families["loraplex_worker_decode_thread_switches"].samples[0].value == worker.loop.engine.threads.num_switches


def test_a_request_the_worker_cannot_run_is_a_refusal_not_an_exception(worker) -> None:
    unknown = asyncio.run(collect(worker, call(1, scales_by_fingerprint={"zz": 1.0})))
    # another replica may hold it
    assert len(unknown) == 1 and unknown[0].status == 503 and "not loaded on this replica" in unknown[0].error
    too_long = asyncio.run(collect(worker, call(2, max_tokens=500)))
    assert too_long[0].status == 400 and "exceeds the context length" in too_long[0].error


def test_a_full_queue_refuses_with_503_and_a_deadline_ends_a_request(worker, monkeypatch) -> None:
    step = worker.loop.engine.step

    def slow_step():  # the tiny model is fast: steps of 5 ms keep the queue full long enough to see it
        time.sleep(0.005)
        return step()

    monkeypatch.setattr(worker.loop.engine, "step", slow_step)

    async def run():
        long = [asyncio.create_task(collect(worker, call(10 + i, max_tokens=40))) for i in range(6)]  # 2 run, 4 wait: full
        for _ in range(200):
            if worker.loop.num_queued >= 4:
                break
            await asyncio.sleep(0.005)
        refused = await collect(worker, call(20))
        done = await asyncio.gather(*long)
        late = await collect(worker, call(21, max_tokens=50, timeout_s=0.01))
        return refused, late, done

    refused, late, done = asyncio.run(run())
    assert refused[0].status == 503 and "busy" in refused[0].error
    assert late[-1].finish_reason == "error" and late[-1].status in (503, 504) and "deadline" in late[-1].error
    assert all(d[-1].finish_reason == "length" for d in done)


def test_a_caller_that_falls_behind_gets_the_tokens_so_far_as_one_delta(worker) -> None:
    async def slowly(c: WorkerCall) -> list:
        deltas = []
        batches = worker.channel("slow")
        await batches.__anext__()
        assert await worker.start("slow", c) is None
        while not (deltas and deltas[-1].is_finished):
            deltas += await batches.__anext__()
            await asyncio.sleep(0.05)  # a busy caller: the engine runs ahead
        await batches.aclose()
        return deltas

    keeping_up = asyncio.run(collect(worker, call(30, max_tokens=40)))
    lagging = asyncio.run(slowly(call(30, max_tokens=40)))
    assert sum(len(d.token_ids) for d in keeping_up) == 40 and len(lagging) < 40  # fewer deltas than tokens when behind
    assert [t for d in lagging for t in d.token_ids] == [t for d in keeping_up for t in d.token_ids]
    assert "".join(d.text for d in lagging) == "".join(d.text for d in keeping_up)
    assert lagging[-1].finish_reason == "length" and lagging[-1].usage.completion_tokens == 40


def test_pins_change_between_steps_by_fingerprint_and_a_dropped_one_waits_for_its_requests(
    worker, tiny_llama, tmp_path, monkeypatch
) -> None:
    import worker.residency.residency as residency_module
    from worker.formats.adapter import load_adapter
    from worker.formats.gguf_file import GGUFFile

    monkeypatch.setattr(residency_module, "DRAIN_GRACE_S", 0.0)
    seed_fp = seed_fingerprint(worker)
    new = write_adapter(tmp_path / "n.gguf", random_lora(tiny_llama, ["blk.1.attn_v.weight"], 4, seed=9))
    new_fp = load_adapter(new, GGUFFile(tiny_llama.path)).fingerprint
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"nope")
    worker.residency.store.put(new, new_fp)  # what the registry does before it pins an adapter
    worker.residency.store.put(broken, "f" * 64)

    async def scenario():
        state = await worker.sync(10, [seed_fp, new_fp, "f" * 64])
        assert state["held"] == sorted([seed_fp, new_fp]) and list(state["failed"]) == ["f" * 64]  # the bad pin alone fails
        assert (await worker.sync(3, []))["held"] == state["held"]  # an older version (a lagging gateway) changes nothing
        by_fp = await collect(worker, call(30, scales_by_fingerprint={new_fp: 1.0}))
        assert by_fp[-1].finish_reason == "length"
        long_call = call(31, max_tokens=40, scales_by_fingerprint={new_fp: 1.0})
        running = asyncio.ensure_future(collect(worker, long_call))
        await asyncio.sleep(0.05)
        state = await worker.sync(11, [seed_fp])  # unpinned while a request runs on it
        assert state["held"] == [seed_fp] and state["draining"] == [new_fp]
        await worker.residency.reap()
        assert new_fp in worker.residency.known or running.done()  # kept while its request runs
        deltas = await running
        assert sum(len(d.token_ids) for d in deltas) == 40 and deltas[-1].finish_reason == "length"
        await worker.residency.reap()
        assert new_fp not in worker.residency.known and worker.runner.lora.nbytes() == worker.runner.lora.nbytes(0)
        refused = await collect(worker, call(32, scales_by_fingerprint={new_fp: 1.0}))
        assert refused[-1].status == 503

    asyncio.run(scenario())
    assert worker.health()["pins"]["version"] == 11 and "loraplex_worker_adapters{state=\"held\"} 1" in worker.metrics()


def test_the_mailbox_wakes_the_event_loop_once_for_everything_posted_before_it_runs() -> None:
    import threading

    from worker.contract.calls import Delta
    from worker.shard.channel import Mailbox

    async def scenario() -> tuple[int, list[int]]:
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: wakeups.append(1) or original(*a)  # type: ignore[method-assign]
        mailbox, queues = Mailbox(loop), [asyncio.Queue() for _ in range(4)]

        def engine_step() -> None:  # one step's outputs, from another thread
            for i, queue in enumerate(queues):
                mailbox.post(queue.put_nowait, Delta((i,), str(i), request_id=f"r{i}"))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()
        got = [(await asyncio.wait_for(q.get(), 5)).token_ids[0] for q in queues]
        return len(wakeups), got

    wakeups, got = asyncio.run(scenario())
    assert wakeups == 1 and got == [0, 1, 2, 3]


def test_a_channel_carries_every_request_of_a_step_in_one_batch(worker) -> None:
    """Requests started on a channel get the deltas they get alone, several requests'
    deltas to a batch; a cancelled one stops, and closing the channel stops the rest."""
    async def scenario() -> None:
        alone = [await collect(worker, call(i, max_tokens=24)) for i in range(2)]  # long enough to overlap once both start
        batches = worker.channel("c1")
        assert await batches.__anext__() == []  # open
        with pytest.raises(LookupError, match="no channel"):
            await worker.start("other", call(0))
        assert [await worker.start("c1", call(i, max_tokens=24)) for i in range(2)] == [None, None]
        got: dict[str, list] = {"r0": [], "r1": []}
        sizes = []
        while not all(d and d[-1].is_finished for d in got.values()):
            batch = await asyncio.wait_for(batches.__anext__(), 30)
            sizes.append(len(batch))
            for delta in batch:
                got[delta.request_id].append(delta)
        for i, deltas in enumerate(alone):
            assert [t for d in got[f"r{i}"] for t in d.token_ids] == [t for d in deltas for t in d.token_ids]
            assert got[f"r{i}"][-1].usage.completion_tokens == 24
        assert max(sizes) == 2 and len(sizes) < sum(len(d) for d in got.values())  # both requests' deltas of a step together
        refused = await worker.start("c1", call(3, max_tokens=500))
        assert refused.status == 400
        assert await worker.start("c1", call(4, max_tokens=40)) is None
        worker.cancel("c1", "r4")
        assert await worker.start("c1", call(5, max_tokens=40)) is None
        await asyncio.wait_for(batches.__anext__(), 30)
        await batches.aclose()  # the caller went away: r5 stops too
        deadline = time.monotonic() + 10
        while worker.loop.engine.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not worker.loop.engine.has_work() and "c1" not in worker._channels

    asyncio.run(scenario())


def test_a_pinned_adapter_is_read_and_its_dora_norms_made_off_the_step_loop(worker, tiny_llama, tmp_path, monkeypatch) -> None:
    """The file's halves and a DoRA's row norms are made in a thread of their own: the engine's thread
    (the step loop) only puts them on the device."""
    import threading

    import worker.lora.attach as attach
    from tests.worker.formats.test_dora import dora_file
    from worker.formats.adapter import load_adapter
    from worker.formats.gguf_file import GGUFFile

    path = dora_file(tiny_llama, tmp_path / "d.gguf")
    fingerprint = load_adapter(path, GGUFFile(tiny_llama.path)).fingerprint
    worker.residency.store.put(path, fingerprint)
    made_in: list[str] = []
    made = attach.row_norm_terms

    def recorded(*args):
        made_in.append(threading.current_thread().name)
        return made(*args)

    monkeypatch.setattr(attach, "row_norm_terms", recorded)

    async def scenario():
        state = await worker.sync(20, [seed_fingerprint(worker), fingerprint])
        assert fingerprint in state["held"], state
        deltas = await collect(worker, call(40, scales_by_fingerprint={fingerprint: 1.0}))
        assert deltas[-1].finish_reason == "length"

    asyncio.run(scenario())
    assert made_in and not {threading.main_thread().name, "loraplex-engine"} & set(made_in), made_in
