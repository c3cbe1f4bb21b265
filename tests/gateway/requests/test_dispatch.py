"""The gateway's request path over a fake pool (no model, no torch in the workers): what a
worker is called with, routing by adapters, failover, refusals and mid-stream failures."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from gateway.catalog import Catalog
from gateway.compose import Gateway
from gateway.errors import GatewayError
from gateway.policy.routing import candidates, choose
from gateway.requests.health import _shard_state
from gateway.tenancy.ratelimit import RateLimiter
from tests.gateway.fake_pool import FakePool
from tests.gateway.gateway_setup import tiny_config
from worker.contract.calls import Delta
from worker.contract.params import SamplingParams

PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def config(tiny_llama, tmp_path_factory):
    return tiny_config(tiny_llama, tmp_path_factory.mktemp("dispatch"), f"loraplex-test-{uuid.uuid4().hex}")


@pytest.fixture
def gateway(config):
    return Gateway(config, Catalog(config), FakePool(config), RateLimiter())


def prepare(gateway: Gateway, adapters: dict[str, float], max_tokens: int = 3, tenant: str = "t1",
            timeout_s: float | None = None):
    params = SamplingParams(max_tokens=max_tokens)
    return asyncio.run(gateway.admission.prepare(gateway.tenants.by_id[tenant], PROMPT, params, adapters,
                                                 timeout_s=timeout_s))


def run(gateway: Gateway, adapters: dict[str, float], max_tokens: int = 3, tenant: str = "t1", stream: bool = False,
        timeout_s: float | None = None):
    prepared = prepare(gateway, adapters, max_tokens, tenant, timeout_s)

    async def go():
        if not stream:
            return await gateway.dispatcher.collect(prepared)
        return [delta async for delta in gateway.dispatcher.stream(prepared)]

    return prepared, asyncio.run(go())


def test_the_worker_gets_a_typed_call_on_a_replica_holding_the_adapters(gateway) -> None:
    prepared, deltas = run(gateway, {"b": 0.5})
    (replica, call), = gateway.pool.calls
    assert replica == "s2-0" and prepared.route == {"replica": "s2-0", "shard": "s2"}
    assert call.prompt_ids == tuple(PROMPT) and call.params.max_tokens == 3
    # by content (docs/architecture.md#fingerprints), not by name
    assert dict(call.scales_by_fingerprint) == {gateway.catalog.adapters["b"].fingerprint: 0.5}
    assert call.tenant == "t1" and call.cache_salt == "tenant:t1" and call.cache_prompt
    assert [d.token_ids for d in deltas] == [(11,), (12,), (13,)] and deltas[-1].usage.completion_tokens == 3
    run(gateway, {"alo": 1.0})
    assert gateway.pool.calls[-1][0].startswith("s1-")


def test_a_dead_replica_is_skipped_and_marked_down(gateway) -> None:
    gateway.pool.killed.add("s1-0")
    results = [run(gateway, {"alo": 1.0})[1] for _ in range(4)]
    assert all(deltas[-1].finish_reason == "length" for deltas in results)  # no request lost
    tried = [replica for replica, _ in gateway.pool.calls]
    assert tried.count("s1-0") == 1 and tried.count("s1-1") == 4  # tried once, then down for its cool-down
    assert {v.replica_id: v.is_healthy for v in gateway.dispatcher.views()} == {"s1-0": False, "s1-1": True, "s2-0": True}
    health = asyncio.run(gateway.health.full())
    assert health["status"] == "degraded" and health["shards"]["s1"]["healthy"] == 1


def test_a_refusal_is_the_requests_error_and_is_not_retried(gateway) -> None:
    gateway.pool.refusal = "adapter slot 9 does not exist"
    with pytest.raises(GatewayError) as e:
        run(gateway, {"b": 1.0})
    assert e.value.status == 400 and "slot 9" in e.value.message
    assert len(gateway.pool.calls) == 1 and all(v.is_healthy and v.in_flight == 0 for v in gateway.dispatcher.views())


def test_a_replica_dying_mid_stream_ends_the_stream_but_a_whole_request_goes_elsewhere(gateway) -> None:
    _, deltas = run(gateway, {"b": 1.0}, max_tokens=4)
    gateway.pool.fail_after["s2-0"] = 2
    _, streamed = run(gateway, {"b": 1.0}, max_tokens=4, stream=True)
    assert [d.token_ids for d in streamed[:2]] == [(11,), (12,)]
    assert streamed[-1].finish_reason == "error" and "mid-stream" in streamed[-1].error and len(streamed) == 3
    assert not {v.replica_id: v.is_healthy for v in gateway.dispatcher.views()}["s2-0"]
    probe = prepare(gateway, {"alo": 1.0}, 4)
    pool = candidates(gateway.dispatcher.views(), probe.scales_by_fingerprint)
    favourite = choose(pool, probe.affinity, gateway.config.routing).replica_id
    gateway.pool.fail_after[favourite] = 2
    _, whole = run(gateway, {"alo": 1.0}, max_tokens=4)
    # the whole request, again, on the other replica
    assert [d.token_ids for d in whole] == [d.token_ids for d in deltas]
    assert [r for r, _ in gateway.pool.calls[-2:]] == [favourite, ({"s1-0", "s1-1"} - {favourite}).pop()]


def test_health_and_metrics_ask_every_replica_at_once_within_a_timeout(tiny_llama, tmp_path) -> None:
    class Slow(FakePool):
        in_flight = peak = 0

        async def _answer(self, value):
            Slow.in_flight += 1
            Slow.peak = max(Slow.peak, Slow.in_flight)
            try:
                await asyncio.sleep(0.2 if value != "hang" else 60)
            finally:
                Slow.in_flight -= 1
            return value

        async def health(self, replica_id: str):
            return await self._answer("hang" if replica_id == "s2-0" else {"cache": {"redis": "off"}})

        async def metrics(self, replica_id: str):
            return await self._answer("hang" if replica_id == "s2-0" else "")

    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}", routing={"health_timeout_s": 0.5})
    gateway = Gateway(config, Catalog(config), Slow(config), RateLimiter())
    health = asyncio.run(gateway.health.full())
    assert Slow.peak == 3  # all three replicas at once
    s2 = {"id": "s2-0", "in_flight": 0, "healthy": False, "error": "TimeoutError"}
    assert health["shards"]["s2"]["replicas"][0] == s2
    assert health["status"] == "down"  # s2's only replica did not answer in time
    Slow.peak = 0
    asyncio.run(gateway.dispatcher.full_metrics())
    assert Slow.peak == 3


class Busy(FakePool):
    """Replicas in `full` refuse every call as too busy (503), as a worker whose slots and queue are full does."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.full: set[str] = set()

    async def stream(self, replica_id: str, call):
        if replica_id in self.full:
            self.calls.append((replica_id, call))
            yield Delta.refused("the worker is full", status=503)
            return
        async for delta in super().stream(replica_id, call):
            yield delta


@pytest.mark.parametrize("stream", [False, True])
def test_a_busy_refusal_goes_to_the_next_replica_and_is_the_error_when_none_is_left(config, stream) -> None:
    gateway = Gateway(config, Catalog(config), Busy(config), RateLimiter())
    probe = prepare(gateway, {"alo": 1.0})
    favourite = choose(candidates(gateway.dispatcher.views(), probe.scales_by_fingerprint), probe.affinity, gateway.config.routing)
    other = ({"s1-0", "s1-1"} - {favourite.replica_id}).pop()
    gateway.pool.full.add(favourite.replica_id)
    _, deltas = run(gateway, {"alo": 1.0}, stream=stream)
    assert deltas[-1].finish_reason == "length" and [r for r, _ in gateway.pool.calls] == [favourite.replica_id, other]
    assert all(v.is_healthy and v.in_flight == 0 for v in gateway.dispatcher.views())  # busy is not failed
    gateway.pool.full.add(other)
    with pytest.raises(GatewayError) as e:
        run(gateway, {"alo": 1.0}, stream=stream)
    assert (e.value.status, e.value.code, e.value.message) == (503, "worker_busy", "the worker is full")
    assert e.value.headers == {"Retry-After": "1"} and len(gateway.pool.calls) == 4  # each replica once, no more


@pytest.mark.parametrize(("stream", "what"), [(False, "run"), (True, "take")])
def test_after_max_attempts_failed_replicas_the_request_gives_up(config, stream, what) -> None:
    gateway = Gateway(config, Catalog(config), FakePool(config), RateLimiter())
    gateway.pool.killed.update({"s1-0", "s1-1"})
    with pytest.raises(GatewayError) as e:
        run(gateway, {"alo": 1.0}, stream=stream)
    message = f"the workers failed to {what} the request"
    assert (e.value.status, e.value.code, e.value.message) == (503, "worker_failed", message)
    assert len(gateway.pool.calls) == gateway.config.routing.max_attempts == 2
    assert not any(v.is_healthy for v in gateway.dispatcher.views() if v.shard == "s1")
    with pytest.raises(GatewayError) as e:  # both in their cool-down, yet reachable: tried again rather than refused
        run(gateway, {"alo": 1.0}, stream=stream)
    assert (e.value.status, e.value.code) == (503, "worker_failed") and len(gateway.pool.calls) == 4
    gateway.pool.unreachable.update({"s1-0", "s1-1"})
    started = time.monotonic()
    with pytest.raises(GatewayError) as e:  # known gone: nothing to try, once they stayed so for unresponsive_after_s
        run(gateway, {"alo": 1.0}, stream=stream)
    assert (e.value.status, e.value.code) == (503, "no_healthy_worker") and len(gateway.pool.calls) == 4
    assert gateway.config.routing.unresponsive_after_s <= time.monotonic() - started < gateway.config.routing.unresponsive_after_s + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_finding_no_replica_reachable_waits_for_one_to_be_heard_from_again(config, stream) -> None:
    gateway = Gateway(config, Catalog(config), FakePool(config), RateLimiter())
    gateway.pool.unreachable.update({"s1-0", "s1-1"})
    prepared = prepare(gateway, {"alo": 1.0})

    async def scenario():
        asyncio.get_running_loop().call_later(0.5, gateway.pool.unreachable.discard, "s1-1")
        if not stream:
            return await gateway.dispatcher.collect(prepared)
        return [delta async for delta in gateway.dispatcher.stream(prepared)]

    started = time.monotonic()
    deltas = asyncio.run(scenario())
    assert deltas[-1].finish_reason == "length" and [r for r, _ in gateway.pool.calls] == ["s1-1"]
    assert 0.5 <= time.monotonic() - started < gateway.config.routing.unresponsive_after_s


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_that_failed_lately_is_passed_over_while_another_answers(config, stream) -> None:
    gateway = Gateway(config, Catalog(config), FakePool(config), RateLimiter())
    gateway.pool.fail_after["s1-0"] = 0
    gateway.pool.killed.add("s1-1")
    with pytest.raises(GatewayError):
        run(gateway, {"alo": 1.0}, stream=stream)  # both fail: both in their cool-down
    gateway.pool.killed.clear()
    gateway.dispatcher._failed_until_s.pop("s1-1")  # s1-1's cool-down is over; s1-0's is not
    for _ in range(3):
        _, deltas = run(gateway, {"alo": 1.0}, stream=stream)
        assert deltas[-1].finish_reason == "length"
    assert [r for r, _ in gateway.pool.calls[2:]] == ["s1-1"] * 3
    gateway.pool.unreachable.add("s1-1")  # s1-1 gone: s1-0, though in its cool-down, is all there is
    _, deltas = run(gateway, {"alo": 1.0}, stream=stream)
    assert deltas[-1].finish_reason == "length" and gateway.pool.calls[-1][0] == "s1-0"


class Stalls(FakePool):
    """Every replica sends one delta, then nothing."""

    async def stream(self, replica_id: str, call):
        self.calls.append((replica_id, call))
        yield Delta((call.prompt_ids[0],), "x")
        await asyncio.sleep(60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_replica_past_the_deadline_is_marked_down_and_not_retried(tiny_llama, tmp_path, stream) -> None:
    config = tiny_config(tiny_llama, tmp_path, f"loraplex-test-{uuid.uuid4().hex}", routing={"worker_grace_s": 0.0})
    gateway = Gateway(config, Catalog(config), Stalls(config), RateLimiter())
    if stream:  # the first delta went out: the stream ends with the deadline's error
        _, deltas = run(gateway, {"b": 1.0}, stream=True, timeout_s=0.3)
        assert deltas[-1].finish_reason == "error" and deltas[-1].status == 504 and len(deltas) == 2
    else:
        with pytest.raises(GatewayError) as e:
            run(gateway, {"b": 1.0}, timeout_s=0.3)
        assert (e.value.status, e.value.code) == (504, "timeout")
    assert len(gateway.pool.calls) == 1 and not {v.replica_id: v.is_healthy for v in gateway.dispatcher.views()}["s2-0"]


def test_an_adapter_gone_between_its_resolution_and_admission_is_a_404_not_a_500(gateway) -> None:
    """The names were resolved, then the adapter went (removed, or hidden from the tenant) while the
    request waited on its limits: a 404 in the API's shape, and nothing held."""
    async def scenario() -> None:
        tenant = gateway.tenants.by_id["t1"]
        scales = gateway.admission.resolve_scales(tenant, "a", None)
        gateway.registry._visible[(tenant.id, tenant.allowed)] = {}  # what a refresh that dropped it leaves
        with pytest.raises(GatewayError) as refused:
            await gateway.admission.prepare(tenant, PROMPT, SamplingParams(max_tokens=3), scales)
        assert refused.value.status == 404 and refused.value.code == "adapter_not_found"

    asyncio.run(scenario())


class Scaled(FakePool):
    """Replicas of an autoscaled shard in the phases `phases` (gateway/cluster/membership.py): one not up is
    never called, and can be woken (gateway/serve.py: ServePool)."""

    def __init__(self, config, phases: dict[str, str]) -> None:
        super().__init__(config)
        self.phases, self.asked, self.woken = phases, [], []

    def phase(self, replica_id: str) -> str:
        return self.phases.get(replica_id, "up")

    def is_reachable(self, replica_id: str) -> bool:
        return self.phase(replica_id) == "up"

    async def health(self, replica_id: str):
        self.asked.append(replica_id)
        return {"cache": {"redis": "off"}}

    async def metrics(self, replica_id: str):
        self.asked.append(replica_id)
        return ""

    def wake(self, replica_ids):
        self.woken.append(sorted(replica_ids))
        for replica_id in replica_ids:
            self.phases[replica_id] = "up"  # at once here: Serve's start, as the membership would see it
        return 30.0


def test_replicas_that_do_not_serve_by_autoscaling_are_not_asked_and_their_shard_is_not_down(config) -> None:
    pool = Scaled(config, {"s1-1": "draining", "s2-0": "asleep"})
    gateway = Gateway(config, Catalog(config), pool, RateLimiter())
    health = asyncio.run(gateway.health.full())
    asyncio.run(gateway.dispatcher.full_metrics())
    assert sorted(pool.asked) == ["s1-0", "s1-0"]  # health and metrics, of the only replica up
    assert health["status"] != "down"  # s1 serves on the one it should; s2 is asleep, not down
    assert [_shard_state(shard) for shard in health["shards"].values()] == ["ok", "ok"]
    assert {r["id"]: r.get("phase") for r in health["shards"]["s1"]["replicas"]} == {"s1-0": None, "s1-1": "draining"}


def test_a_request_for_a_shard_asleep_wakes_it_and_says_how_long_it_waited(config) -> None:
    pool = Scaled(config, {"s2-0": "asleep"})
    gateway = Gateway(config, Catalog(config), pool, RateLimiter())
    prepared = prepare(gateway, {"b": 1.0})  # only s2 holds b
    deltas = asyncio.run(gateway.dispatcher.collect(prepared))
    assert pool.woken == [["s2-0"]] and prepared.route["replica"] == "s2-0"
    assert prepared.cold_start_s > 0 and deltas[-1].prompt_time_s >= prepared.cold_start_s
