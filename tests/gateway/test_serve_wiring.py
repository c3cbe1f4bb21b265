"""The Serve wiring (gateway/serve.py) without a cluster: the node each shard replica's Ray
options prefer, how long Serve waits for replicas to stop, and a stopping gateway ending its
channels to the shard replicas (so that they stop at once). On Ray: test_serve_stop.py."""

from __future__ import annotations

import asyncio

import pytest

from gateway.cluster.pool import WorkerFailed
from gateway.config import ConfigError, parse_config
from gateway.policy.nodes import Node, node_options
from gateway.serve import GATEWAY_STOP_TIMEOUT_S, SHARD_STOP_TIMEOUT_S, STOP_POLL_S, ServePool, build
from worker.contract.calls import WorkerCall
from worker.contract.params import SamplingParams


def config(**shard_fields):
    return parse_config({"model": None, "adapters": [], "cache": {"redis_url": None}, "auth": "none", "state": {"ephemeral": True},
                         "shards": [{"name": "a", "replicas": 2, **shard_fields}, {"name": "b", "replicas": 1}]}, ".")


def shard_deployments(app) -> dict[str, object]:
    """The shard replicas' deployments, from the gateway's bound arguments (config, handles)."""
    return {replica_id: bound._bound_deployment for replica_id, bound in app._bound_deployment.init_args[1].items()}


def test_each_replica_of_a_shard_prefers_another_node_and_may_fall_back_to_any() -> None:
    deployments = shard_deployments(build(config(), [Node("n1", {"CPU": 4}), Node("n2", {"CPU": 4})]))
    options = {replica_id: d.ray_actor_options for replica_id, d in deployments.items()}
    assert options["a-0"]["label_selector"] == {"ray.io/node-id": "n1"}
    assert options["a-1"]["label_selector"] == {"ray.io/node-id": "n2"}
    assert options["b-0"]["label_selector"] == {"ray.io/node-id": "n1"}
    assert all(o["fallback_strategy"] == [{"label_selector": {}}] for o in options.values())  # soft
    assert all(o["num_cpus"] == 1.0 for o in options.values())


def test_without_nodes_ray_places_the_replicas_and_node_labels_stay_a_hard_constraint() -> None:
    deployments = shard_deployments(build(config(node_labels={"pool": "a100"})))
    assert deployments["a-0"].ray_actor_options["label_selector"] == {"pool": "a100"}
    assert "fallback_strategy" not in deployments["a-0"].ray_actor_options
    assert "label_selector" not in deployments["b-0"].ray_actor_options
    assert node_options("n1", {"pool": "a100"}) == {"label_selector": {"ray.io/node-id": "n1", "pool": "a100"},
                                                    "fallback_strategy": [{"label_selector": {"pool": "a100"}}]}


def test_a_bad_node_label_selector_is_a_config_error_that_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"shards\[0\]\.node_labels: label selector pool"):
        config(node_labels={"pool": "in()"})


def test_serve_checks_often_whether_a_stopping_replica_is_done_and_waits_a_bounded_time() -> None:
    app = build(config())
    gateway = app._bound_deployment
    assert gateway._deployment_config.graceful_shutdown_timeout_s == GATEWAY_STOP_TIMEOUT_S
    for deployment in [gateway, *shard_deployments(app).values()]:
        assert deployment._deployment_config.graceful_shutdown_wait_loop_s == STOP_POLL_S
    assert all(d._deployment_config.graceful_shutdown_timeout_s == SHARD_STOP_TIMEOUT_S for d in shard_deployments(app).values())


class FakeStream:
    """A replica's channel stream that stays open until cancelled, as a real one does."""

    def __init__(self) -> None:
        self.is_cancelled = False
        self._cancelled = asyncio.Event()

    def __aiter__(self):
        return self._batches()

    async def _batches(self):
        yield []  # the channel is open
        await self._cancelled.wait()
        raise asyncio.CancelledError

    def cancel(self) -> None:
        self.is_cancelled = True
        self._cancelled.set()


class FakeHandle:
    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        handle = self

        class Method:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args):
                if self.name == "channel":
                    handle.streams.append(FakeStream())
                    return handle.streams[-1]

                async def answer() -> None:
                    return None  # started; its deltas would come on the channel

                return answer()

        self.channel, self.start, self.cancel = Method("channel"), Method("start"), Method("cancel")

    def options(self, **_: object) -> FakeHandle:
        return self


def test_a_stopping_gateway_cancels_every_channel_and_fails_the_requests_still_on_them() -> None:
    async def scenario() -> None:
        handles = {"a-0": FakeHandle(), "a-1": FakeHandle(), "b-0": FakeHandle()}
        pool = ServePool(config(), handles)
        request = WorkerCall("r1", (1, 2, 3), SamplingParams(max_tokens=4))
        waiting = asyncio.ensure_future(pool.stream("a-0", request).__anext__())
        await asyncio.sleep(0.05)
        assert not waiting.done()  # started, waiting for its deltas
        pool.close()
        assert [s.is_cancelled for s in handles["a-0"].streams] == [True]  # at once: the replica may be killed next
        with pytest.raises(WorkerFailed, match="stopping"):
            await asyncio.wait_for(waiting, 5)
        assert handles["a-1"].streams == []  # never opened: nothing to end

    asyncio.run(scenario())


class CountingHandle(FakeHandle):
    """A FakeHandle that counts the calls of each method (health, sync, metrics answered at once)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        handle = self

        class Counted:
            def __init__(self, name: str, inner=None) -> None:
                self.name, self.inner = name, inner

            def remote(self, *args):
                handle.calls.append(self.name)
                if self.inner is not None:
                    return self.inner.remote(*args)

                async def answer():
                    return {"held": [], "version": 0} if self.name == "sync" else {}

                return answer()

        self.channel, self.start = Counted("channel", self.channel), Counted("start", self.start)
        self.health, self.sync, self.metrics = Counted("health"), Counted("sync"), Counted("metrics")


def test_an_autoscaled_shards_replicas_are_called_only_while_up_and_one_asleep_is_woken_once() -> None:
    scaled = config(autoscaling={"min_replicas": 0, "max_replicas": 2})
    status = {"a-0": ("HEALTHY", {}), "a-1": ("HEALTHY", {})}

    async def scenario() -> None:
        handles = {"a-0": CountingHandle(), "a-1": CountingHandle(), "b-0": CountingHandle()}
        pool = ServePool(scaled, handles, read_status=lambda: status)
        assert pool.phase("b-0") == "up" and pool.is_reachable("b-0")  # a fixed shard is followed by its channel alone
        await pool.membership.update(status)
        assert (pool.phase("a-0"), pool.is_reachable("a-0")) == ("asleep", False)
        for call in (pool.health("a-0"), pool.sync("a-0", 1, {}), pool.metrics("a-1")):
            with pytest.raises(ConnectionError, match="asleep"):
                await call
        with pytest.raises(WorkerFailed, match="asleep"):
            await pool.stream("a-0", WorkerCall("r1", (1, 2), SamplingParams(max_tokens=2))).__anext__()
        assert handles["a-0"].calls == handles["a-1"].calls == []  # nothing reached a replica asleep
        assert pool.wake(["a-0", "a-1"]) == pytest.approx(120.0) and pool.wake(["a-0"]) == pytest.approx(120.0)
        await asyncio.sleep(0.05)
        assert handles["a-0"].calls == ["health"] and handles["a-1"].calls == []  # its first replica, once
        assert pool.wake(["b-0"]) is None  # not autoscaled: the usual wait
        joined = []

        async def join(replica_id: str) -> None:
            joined.append(replica_id)
            await pool.sync(replica_id, 1, {})  # Serve runs it: it may take its pins before it is up

        pool.membership.joined = join
        status["a-0"] = ("UPSCALING", {"RUNNING": 1})
        await pool.membership.update(status)
        assert pool.phase("a-0") == "up" and joined == ["a-0"] and handles["a-0"].calls == ["health", "sync"]
        await pool.health("a-0")
        status["a-0"] = ("DOWNSCALING", {"STOPPING": 1})
        await pool.membership.update(status)
        assert pool.phase("a-0") == "draining" and not pool.is_reachable("a-0")
        pool.close()

    asyncio.run(scenario())


class HeldHandle(FakeHandle):
    """A FakeHandle of a deployment whose replica Serve stopped: its router holds each start and cancel (no
    replica takes them) until the caller withdraws it."""

    def __init__(self) -> None:
        super().__init__()
        self.withdrawn: dict[str, list[bool]] = {"start": [], "cancel": []}  # each call held: withdrawn since
        handle = self

        class Held:
            def __init__(self, name: str) -> None:
                self.name = name

            def remote(self, *args):
                calls = handle.withdrawn[self.name]
                calls.append(False)

                async def held(i: int = len(calls) - 1) -> None:
                    try:
                        await asyncio.Event().wait()
                    except asyncio.CancelledError:
                        calls[i] = True
                        raise

                return held()

        self.start, self.cancel = Held("start"), Held("cancel")


def test_no_call_routed_before_the_gateway_read_a_scale_down_stays_held_for_the_replica() -> None:
    """Serve would start the replica again for a call its router holds (its cold start): the drain withdraws
    the starts it holds and the cancels sent before it, and sends none of its own; a cancel to a replica
    that serves is never withdrawn for taking its time."""
    status = {"a-0": ("HEALTHY", {"RUNNING": 1}), "a-1": ("HEALTHY", {"RUNNING": 1})}

    async def scenario() -> None:
        handles = {"a-0": FakeHandle(), "a-1": HeldHandle(), "b-0": FakeHandle()}
        pool = ServePool(config(autoscaling={"min_replicas": 1, "max_replicas": 2}), handles, read_status=lambda: status)
        await pool.membership.update(status)
        left = asyncio.ensure_future(pool.stream("a-1", WorkerCall("r0", (1, 2), SamplingParams(max_tokens=2))).__anext__())
        await asyncio.sleep(0.05)
        left.cancel()  # its client leaves: a cancel goes to the replica, which serves but is slow to take it
        await asyncio.sleep(2.5)  # longer than any fixed bound worth having: a cancel is not given up for its time
        assert handles["a-1"].withdrawn == {"start": [True], "cancel": [False]}
        # Serve scaled a-1 down and its router holds what comes for it; the gateway has not read it yet
        waiting = asyncio.ensure_future(pool.stream("a-1", WorkerCall("r1", (1, 2), SamplingParams(max_tokens=2))).__anext__())
        await asyncio.sleep(0.05)
        assert not waiting.done() and handles["a-1"].withdrawn == {"start": [True, False], "cancel": [False]}
        status["a-1"] = ("DOWNSCALING", {"STOPPING": 1})
        await pool.membership.update(status)  # the next reading: it drains
        with pytest.raises(WorkerFailed, match="scaled down"):  # before any delta: another replica takes it
            await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0.05)
        assert handles["a-1"].withdrawn == {"start": [True, True], "cancel": [True]}  # nothing left held, none sent
        pool.close()

    asyncio.run(scenario())
