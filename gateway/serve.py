"""The Ray Serve application: shard replicas, the gateway ingress, and `app_from_config` for KubeRay.

Every replica of every shard is its own Serve deployment (`shard-<shard>-<i>`,
one replica each, one device each) so that the gateway, not Serve's router,
chooses the replica a request goes to (docs/architecture.md#routing-and-placement); Serve restarts a replica that
dies. The gateway is the ingress deployment: the FastAPI app of gateway/api/app.py
holding a handle to every shard replica; responses stream through the handles. Each
gateway replica listens on the HTTP port itself (gateway/cluster/listener.py), or, with
`http.listener: serve-proxy`, Serve's proxies take HTTP and call the gateway replicas.

`loraplex serve` itself (check, join or start Ray, deploy, stop) is gateway/launch.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from ray import serve

from gateway.cluster.autoscaling import deployment_autoscaling
from gateway.cluster.channel import Channels, ReplicaChannel
from gateway.cluster.membership import ASLEEP, STARTING, UP, Membership, Status
from gateway.cluster.pool import NotServing, WorkerFailed, replica_infos
from gateway.cluster.ray_nodes import alive_nodes, this_node
from gateway.config import ConfigError, ServeConfig, ShardConfig, parse_config
from gateway.policy.nodes import Node, ReplicaDemand, node_options, spread
from worker.contract.calls import Delta, WorkerCall
from worker.contract.spec import WorkerSpec

log = logging.getLogger(__name__)

APP_NAME = "loraplex"
# Stopping. A stopping replica looks this often whether its requests are done (Serve's default: 2 s,
# which made each step of a stop wait whole seconds); Serve kills a replica not stopped in its timeout:
# a gateway's covers its listener's grace for HTTP requests in flight (gateway/cluster/listener.py, 5 s); a shard
# replica's requests end with the gateways' channels, so its own timeout only matters when a gateway died.
STOP_POLL_S = 0.2
GATEWAY_STOP_TIMEOUT_S = 15.0
SHARD_STOP_TIMEOUT_S = 20.0
# an autoscaled shard's replica scaled down drains first: the gateways send it nothing new and close their
# channels once its requests are done, which Serve waits for this long at most (then it stops it anyway)
DRAIN_TIMEOUT_S = 300.0
# a request for a shard asleep (autoscaling with min_replicas 0) wakes it and waits this long at most for a
# replica to start (the model and the shard's adapters loaded), within its own deadline
COLD_START_TIMEOUT_S = 120.0

# Ray Serve's settings for throughput (what its RAY_SERVE_THROUGHPUT_OPTIMIZED turns on, less direct
# ingress, which moves the HTTP port): user code and the handles' router on each replica's own event
# loop, no hop between threads per streamed item; access logs flushed in batches. And less polling:
# the controller's loop every 0.5 s (not 0.1) and replicas' Ray metrics every 1 s (not 0.1), which
# halved the controller's CPU under load (3.4% -> 1.7% of a core on 2 cores, 16 streams). Set for
# every Ray process (`loraplex serve` before it starts Ray; the Helm chart in each Ray container).
SERVE_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
}


def _build_app():
    """Evaluated in the ingress replica. Both this and the constructor reach the replica's
    Gateway through the gateway.api.app module itself: Serve pickles the deployment class by
    value, so a global of this module would be a copy."""
    import gateway.api.app as api

    return api.create_app(api.process_gateway)


@serve.deployment(max_ongoing_requests=64, health_check_period_s=5, health_check_timeout_s=30,
                  graceful_shutdown_wait_loop_s=STOP_POLL_S, graceful_shutdown_timeout_s=SHARD_STOP_TIMEOUT_S)
class ShardReplica:
    def __init__(self, spec: WorkerSpec) -> None:
        from worker.shard import ShardWorker  # torch: only in the replica's process

        self.worker = ShardWorker(spec)
        self.node = this_node()

    async def channel(self, channel_id: str) -> AsyncIterator[list[Delta]]:
        async for batch in self.worker.channel(channel_id):
            yield batch

    async def start(self, channel_id: str, call: WorkerCall) -> Delta | None:
        return await self.worker.start(channel_id, call)

    def cancel(self, channel_id: str, request_id: str) -> None:
        self.worker.cancel(channel_id, request_id)

    async def health(self) -> dict[str, Any]:
        return {**self.worker.health(), "node": self.node}

    async def sync(self, version: int, pins: dict[str, str]) -> dict[str, Any]:
        return await self.worker.sync(version, pins)

    async def metrics(self) -> str:
        return self.worker.metrics()

    def record_autoscaling_stats(self) -> dict[str, float]:  # what an autoscaled shard's policy reads (gateway/cluster/autoscaling.py)
        return self.worker.autoscaling_stats()

    def check_health(self) -> None:  # Serve restarts a replica whose engine thread died
        if not self.worker.loop.is_alive():
            raise RuntimeError("the engine loop stopped")


def serve_status() -> Status:
    """Serve's status of each shard replica's deployment, by replica id (gateway/cluster/membership.py)."""
    app = serve.status().applications.get(APP_NAME)
    prefix = "shard-"
    return {name[len(prefix):]: (str(dep.status.value), {str(getattr(k, "value", k)): n for k, n in dep.replica_states.items()})
            for name, dep in (app.deployments if app else {}).items() if name.startswith(prefix)}


class ServePool:
    """The shard replicas behind their Serve handles: requests go over one channel per replica
    (gateway/cluster/channel.py), opened on first use and again after the replica failed. The
    replicas of autoscaled shards are followed as Serve starts and stops them (`membership`):
    only those up are routed to or called."""

    def __init__(self, config: ServeConfig, handles: dict[str, Any], read_status: Any = serve_status) -> None:
        self.handles = handles
        self.replicas = replica_infos(config)
        self._unresponsive_after_s = config.routing.unresponsive_after_s
        self.channels = Channels(self._open_channel)
        self._streams: dict[str, Any] = {}  # each replica's latest channel stream (a DeploymentResponseGenerator)
        scaled = {s.name for s in config.shards if s.autoscaling is not None}
        self.membership = Membership([r.replica_id for r in self.replicas if r.shard in scaled], read_status,
                                     leaving=self._drain) if scaled else None
        self._following: Any = None  # the membership's task
        self._waking: dict[str, Any] = {}  # shard -> the call that wakes it (a task)

    def phase(self, replica_id: str) -> str:
        """up, or (an autoscaled shard's replica) starting, draining or asleep."""
        if self.membership is None:
            return UP
        if self._following is None or self._following.done():
            try:  # followed from the gateway's event loop, once it asks
                self._following = asyncio.get_running_loop().create_task(self.membership.run())
            except RuntimeError:  # asked from outside it: the phases as last read
                pass
        return self.membership.phase(replica_id)

    def _serving(self, replica_id: str, may_be_joining: bool = False) -> None:
        """Raise NotServing unless the replica is up (or, `may_be_joining`, Serve runs it: it takes its pins)."""
        phase = self.phase(replica_id)
        if phase != UP and not (may_be_joining and self.membership is not None and self.membership.serving.get(replica_id)):
            raise NotServing(f"replica {replica_id} is {phase}")

    def wake(self, replica_ids: Sequence[str]) -> float | None:
        """A request may go only to these replicas and none is up: where their autoscaled shard is asleep,
        call its first replica (Serve's router holds the call, its autoscaling starts the replica: its
        policy sees a request queued for a shard with none); how long to wait for one, or None when
        none of their shards is asleep or starting (they are down: the usual short wait)."""
        if self.membership is None:
            return None
        shards = {r.shard for r in self.replicas if r.replica_id in replica_ids and r.replica_id in self.membership.phases}
        coming = False
        for shard in shards:
            phases = [self.membership.phase(r.replica_id) for r in self.replicas if r.shard == shard]
            if all(p == ASLEEP for p in phases) and shard not in self._waking:
                self._waking[shard] = asyncio.ensure_future(self._wake(shard))
            coming = coming or all(p in (ASLEEP, STARTING) for p in phases)
        return COLD_START_TIMEOUT_S if coming else None

    async def _wake(self, shard: str) -> None:
        try:
            await asyncio.wait_for(self.handles[f"{shard}-0"].health.remote(), COLD_START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the requests waiting for it give up on their own bound
            log.warning("shard %s did not wake within %g s (%s: %s)", shard, COLD_START_TIMEOUT_S, type(e).__name__, e)
        finally:
            self._waking.pop(shard, None)

    def _drain(self, replica_id: str) -> None:
        """The replica is being scaled down: its channel takes nothing new and closes once its requests are done."""
        self.channels.drain(replica_id)

    def _open_channel(self, replica_id: str) -> ReplicaChannel:
        handle = self.handles[replica_id]

        def open_stream(channel_id: str) -> Any:
            self._streams[replica_id] = handle.options(stream=True).channel.remote(channel_id)
            return self._streams[replica_id]

        return ReplicaChannel(
            open_stream,
            lambda channel_id, call: handle.start.remote(channel_id, call),
            lambda channel_id, request_id: handle.cancel.remote(channel_id, request_id),
            self._unresponsive_after_s,
        )

    def close(self) -> None:
        """End every channel (the gateway stops): their requests fail here, and each stream is
        cancelled now, so its replica stops at once instead of waiting out Serve's timeout."""
        self.channels.fail_all(WorkerFailed("the gateway is stopping"))
        for stream in self._streams.values():
            stream.cancel()
        for task in (self._following, *self._waking.values()):
            if task is not None:
                task.cancel()

    def is_reachable(self, replica_id: str) -> bool:
        return self.phase(replica_id) == UP and self.channels.is_reachable(replica_id)

    def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        if self.phase(replica_id) != UP:  # chosen as it left: another replica takes the request
            raise WorkerFailed(f"replica {replica_id} is {self.phase(replica_id)}")
        return self.channels.get(replica_id).stream(call)

    async def health(self, replica_id: str) -> dict[str, Any]:
        self._serving(replica_id)
        return await self.handles[replica_id].health.remote()

    async def sync(self, replica_id: str, version: int, pins: dict[str, str]) -> dict[str, Any]:
        self._serving(replica_id, may_be_joining=True)
        return await self.handles[replica_id].sync.remote(version, pins)

    async def metrics(self, replica_id: str) -> str:
        self._serving(replica_id)
        return await self.handles[replica_id].metrics.remote()


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(_build_app)
class GatewayIngress:
    def __init__(self, config: dict[str, Any], handles: dict[str, Any]) -> None:
        from gateway.catalog import Catalog
        from gateway.compose import Gateway
        from gateway.tenancy.ratelimit import open_rate_limiter

        parsed = ServeConfig.model_validate(config)
        import gateway.api.app as api

        self.pool = ServePool(parsed, handles)
        limiter = open_rate_limiter(parsed.state_redis(), parsed.http.gateway_replicas)
        gateway = Gateway(parsed, Catalog(parsed), self.pool, limiter)
        if self.pool.membership is not None:  # a replica that comes up takes its pins before it is routed to
            self.pool.membership.joined = gateway.registry.push_to
        api.set_process_gateway(gateway)
        self.listener = None
        if parsed.http.listener == "gateway":  # this replica serves HTTP itself (Serve's proxies are off)
            from gateway.cluster.listener import Listener

            self.listener = Listener(api.create_app(api.process_gateway), parsed.http.host, parsed.http.port)

    def check_health(self) -> None:  # Serve restarts a gateway whose listener stopped
        failure = self.listener.failure() if self.listener is not None else None
        if failure is not None:
            raise RuntimeError(f"the gateway's HTTP listener stopped: {failure}")

    async def __del__(self) -> None:
        """Serve awaits it once, when the replica stops (after the requests Serve's proxies sent
        it are done): the HTTP requests in flight finish (within the listener's grace), then the
        channels to the shard replicas end."""
        try:
            if self.listener is not None:
                await self.listener.stop()
        finally:
            self.pool.close()


def _shard_options(shard: ShardConfig, index: int) -> dict[str, Any]:
    """A replica deployment's own options: one replica, or (an autoscaled shard) zero or one as its policy says."""
    if shard.autoscaling is None:
        return {"num_replicas": 1}
    return {"autoscaling_config": deployment_autoscaling(shard.name, index, shard.autoscaling),
            "graceful_shutdown_timeout_s": DRAIN_TIMEOUT_S}


def replica_threads(config: ServeConfig) -> int:
    """CPU replicas share the machine's cores (the config's device.threads, when set, wins)."""
    cpu_replicas = sum(s.replicas for s in config.shards if s.num_gpus == 0)
    return max(1, (os.cpu_count() or 1) // max(cpu_replicas, 1))


def _demand(shard: ShardConfig) -> ReplicaDemand:
    return ReplicaDemand(shard.name, shard.num_cpus, shard.num_gpus, shard.node_labels)


def build(config: ServeConfig, nodes: Sequence[Node] = ()) -> serve.Application:
    """The application: every shard replica a deployment, spread over `nodes` (gateway/policy/nodes.py;
    none: where Ray puts them), and the gateway."""
    threads = replica_threads(config)
    shards = {s.name: s for s in config.shards}
    specs = {s.name: config.worker_spec(s.name, threads=threads) for s in config.shards}
    replicas = replica_infos(config)
    preferred = spread([_demand(shards[r.shard]) for r in replicas], nodes)
    handles = {
        r.replica_id: ShardReplica.options(
            name=f"shard-{r.replica_id}", max_ongoing_requests=max(64, 4 * config.engine.num_seq_slots),
            **_shard_options(shards[r.shard], r.index),
            ray_actor_options={"num_cpus": shards[r.shard].num_cpus, "num_gpus": shards[r.shard].num_gpus,
                               **node_options(node_id, shards[r.shard].node_labels)},
        ).bind(specs[r.shard])
        for r, node_id in zip(replicas, preferred)
    }
    ingress = config.http.node_labels  # the nodes that take traffic: one listener on each
    placement = {"max_replicas_per_node": 1} if ingress else {}
    return GatewayIngress.options(name="gateway", num_replicas=config.http.gateway_replicas,
                                  ray_actor_options={"num_cpus": 0, **node_options(None, ingress)}, **placement,
                                  graceful_shutdown_wait_loop_s=STOP_POLL_S, graceful_shutdown_timeout_s=GATEWAY_STOP_TIMEOUT_S,
                                  ).bind(config.model_dump(), handles)


def app_from_config(args: dict[str, Any]) -> serve.Application:
    """The application builder a RayService's serveConfigV2 names (`import_path:
    gateway.serve:app_from_config`, `args: {config: ..., base_dir: ...}`): the same
    `build` as `loraplex serve`, from the same config."""
    if not isinstance(args, dict) or not isinstance(args.get("config"), dict):
        raise ConfigError("serveConfigV2 args need 'config': the loraplex config mapping")
    return build(parse_config(args["config"], args.get("base_dir", "."), "serveConfigV2 args.config"), alive_nodes())


