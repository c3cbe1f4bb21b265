"""The gateway's end of a replica channel (gateway/cluster/channel.py) over an in-process ShardWorker:
each request gets its own deltas back, a consumer that leaves cancels its request, and a
channel that breaks fails every request on it (Ray's transport: tests/gateway/test_serve.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cache.prefix import PrefixCacheConfig
from gateway.cluster.pool import WorkerFailed
from tests.helpers import TEST_DEVICE, channel_to, deltas_of
from worker.contract.calls import WorkerCall
from worker.contract.params import SamplingParams
from worker.contract.spec import DeviceSettings, EngineConfig, WorkerSpec
from worker.shard import ShardWorker


@pytest.fixture(scope="module")
def worker(tiny_llama):
    spec = WorkerSpec("s", str(tiny_llama.path), (), EngineConfig(num_seq_slots=4, slot_len=64),
                      DeviceSettings(device=TEST_DEVICE.device), PrefixCacheConfig(chunk_tokens=8))
    shard = ShardWorker(spec)
    yield shard
    shard.close()


def call(i: int, max_tokens: int = 8) -> WorkerCall:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return WorkerCall(f"g{i}-{time.monotonic_ns()}", (5, 6, 7, i + 10), params)


async def tokens(stream) -> list[int]:
    return [t async for delta in stream for t in delta.token_ids]


def test_requests_over_one_channel_get_what_they_get_alone(worker) -> None:
    async def scenario() -> None:
        alone = [[t for d in await deltas_of(worker, call(i)) for t in d.token_ids] for i in range(3)]
        channel = channel_to(worker)
        together = await asyncio.gather(*(tokens(channel.stream(call(i))) for i in range(3)))
        assert together == alone and all(len(t) == 8 for t in together)
        refused = [d async for d in channel.stream(call(9, max_tokens=500))]
        assert len(refused) == 1 and refused[0].status == 400 and channel.failure is None

    asyncio.run(scenario())


def test_a_caller_that_leaves_cancels_its_request_on_the_worker(worker) -> None:
    async def scenario() -> None:
        channel = channel_to(worker)
        stream = channel.stream(call(1, max_tokens=50))
        await stream.__anext__()
        await stream.aclose()
        deadline = time.monotonic() + 10
        while worker.loop.engine.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not worker.loop.engine.has_work()  # stopped after a few of its 50 tokens
        assert len(await tokens(channel.stream(call(2)))) == 8  # the channel goes on

    asyncio.run(scenario())


def test_a_broken_channel_fails_its_requests_and_the_next_channel_works(worker) -> None:
    async def scenario() -> None:
        channel = channel_to(worker, break_after=3)
        results = await asyncio.gather(*(tokens(channel.stream(call(i, max_tokens=30))) for i in range(2)), return_exceptions=True)
        assert all(isinstance(r, WorkerFailed) and "the replica died" in str(r) for r in results)
        with pytest.raises(WorkerFailed):
            await tokens(channel.stream(call(3)))  # a failed channel takes nothing more
        assert len(await tokens(channel_to(worker).stream(call(4)))) == 8

    asyncio.run(scenario())


def silent_channel(hang_start: bool = False, unresponsive_after_s: float = 0.5):
    """A channel to a replica that opens, then goes silent (its node cut off): no batch, no heartbeat;
    with `hang_start`, starting a request never answers either."""
    from gateway.cluster.channel import ReplicaChannel

    async def batches(channel_id: str):
        yield []
        await asyncio.sleep(3600)

    async def start(channel_id: str, call: WorkerCall):
        if hang_start:
            await asyncio.sleep(3600)
        return None

    return ReplicaChannel(batches, start, lambda channel_id, request_id: None, unresponsive_after_s)


@pytest.mark.parametrize("hang_start", [False, True])
def test_a_silent_replica_fails_its_requests_once_unresponsive(hang_start) -> None:
    async def scenario() -> None:
        channel = silent_channel(hang_start)
        started = time.monotonic()
        with pytest.raises(WorkerFailed, match="sent nothing for 0.5 s"):
            await tokens(channel.stream(call(1)))
        assert 0.4 < time.monotonic() - started < 2.0 and not channel.is_live

    asyncio.run(scenario())


def test_an_idle_replica_is_heard_from_and_its_channel_stays_live(worker) -> None:
    from gateway.cluster.channel import ReplicaChannel
    from worker.contract.calls import CHANNEL_HEARTBEAT_S

    async def scenario() -> None:
        heard: list[float] = []

        async def batches(channel_id: str):
            async for batch in worker.channel(channel_id):
                heard.append(time.monotonic())
                yield batch

        channel = ReplicaChannel(batches, worker.start, worker.cancel, unresponsive_after_s=2 * CHANNEL_HEARTBEAT_S + 0.5)
        await asyncio.sleep(3 * CHANNEL_HEARTBEAT_S + 1)  # idle, past the unresponsive bound
        assert channel.is_live and len(heard) >= 3, heard  # the opening batch and a heartbeat each second
        assert len(await tokens(channel.stream(call(5)))) == 8
        channel.fail(WorkerFailed("done"))

    asyncio.run(scenario())


def test_a_replica_gone_silent_is_unreachable_until_a_new_channel_hears_from_it() -> None:
    from gateway.cluster.channel import Channels, ReplicaChannel

    async def scenario() -> None:
        answering = {"r": False}

        async def batches(channel_id: str):
            yield []
            while True:
                await asyncio.sleep(0.1)
                if answering["r"]:
                    yield []

        opened: list[str] = []

        def open_channel(replica_id: str) -> ReplicaChannel:
            opened.append(replica_id)
            return ReplicaChannel(batches, lambda channel_id, c: asyncio.sleep(0), lambda *_: None, 0.5)

        channels = Channels(open_channel)
        assert channels.is_reachable("r") and opened == []  # never tried: not known gone
        first = channels.get("r")
        assert channels.is_reachable("r") and not first.is_live  # opening for the first time: not known gone either
        await asyncio.sleep(0.05)
        assert channels.is_reachable("r") and first.is_live
        await asyncio.sleep(0.7)  # silent past its bound
        assert first.failure is not None
        assert not channels.is_reachable("r") and len(opened) == 2  # a new channel is the probe
        answering["r"] = True
        await asyncio.sleep(0.05)
        assert channels.is_reachable("r") and channels.get("r") is not first and len(opened) == 2

    asyncio.run(scenario())


def test_a_draining_channel_lets_its_requests_finish_sends_nothing_new_and_then_closes(worker) -> None:
    async def scenario() -> None:
        channel = channel_to(worker)
        running = [channel.stream(call(i, max_tokens=20)) for i in range(2)]
        firsts = [await stream.__anext__() for stream in running]  # both started on the replica
        channel.drain()
        assert channel.failure is None  # requests still run on it
        with pytest.raises(WorkerFailed, match="scaled down"):
            await tokens(channel.stream(call(5)))  # a new one goes elsewhere
        rest = await asyncio.gather(*(tokens(stream) for stream in running))
        assert [len(f.token_ids) + len(r) for f, r in zip(firsts, rest)] == [20, 20]  # they ended as they would
        assert channel.failure is not None and "scaled down" in str(channel.failure)  # then it closed
        deadline = time.monotonic() + 10
        while worker._channels and time.monotonic() < deadline:  # the replica's end closed with it
            await asyncio.sleep(0.05)
        assert not worker._channels

    asyncio.run(scenario())


def test_a_request_whose_start_is_unanswered_when_the_replica_drains_goes_elsewhere() -> None:
    async def scenario() -> None:
        channel = silent_channel(hang_start=True, unresponsive_after_s=30.0)
        stream = channel.stream(call(1))
        waiting = asyncio.ensure_future(tokens(stream))
        await asyncio.sleep(0.2)
        channel.drain()
        with pytest.raises(WorkerFailed, match="scaled down"):
            await asyncio.wait_for(waiting, 5)
        assert channel.failure is not None  # nothing else ran on it: closed

    asyncio.run(scenario())


def test_a_replica_reports_its_slots_requests_and_recent_time_to_first_token_for_autoscaling(worker) -> None:
    async def scenario() -> None:
        before = worker.autoscaling_stats()
        assert before["slots"] == 4 and before["running"] == before["waiting"] == 0
        await deltas_of(worker, call(7))
        after = worker.autoscaling_stats()
        assert after["ttft_p90_s"] > 0 and after["running"] == 0  # the request that ended: its first token's time

    asyncio.run(scenario())
