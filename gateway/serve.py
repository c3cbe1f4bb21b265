"""Ray Serve wiring (the only module that imports ray.serve) and `loraplex serve`.

Every replica of every shard is its own Serve deployment (`shard-<shard>-<i>`,
one replica each, one device each) so that the gateway, not Serve's router,
chooses the replica a request goes to (SPEC §7); Serve restarts a replica that
dies. The gateway is the ingress deployment: the FastAPI app of gateway/api/app.py
holding a handle to every shard replica; responses stream through the handles. Each
gateway replica listens on the HTTP port itself (gateway/listener.py), or, with
`http.listener: serve-proxy`, Serve's proxies take HTTP and call the gateway replicas.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ray import serve

from gateway.channel import ReplicaChannel
from gateway.config import ConfigError, ServeConfig, load_config, parse_config
from gateway.pool import replica_infos
from worker.contract.calls import Delta, WorkerCall
from worker.contract.spec import WorkerSpec

if TYPE_CHECKING:
    from gateway.ratelimit import RateLimiter

log = logging.getLogger(__name__)

SIGNAL_CHECK_S = 0.2  # how often the main thread looks for a Ctrl-C or SIGTERM
SERVE_SHUTDOWN_TIMEOUT_S = 60.0

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


@serve.deployment(max_ongoing_requests=64, health_check_period_s=5, health_check_timeout_s=30)
class ShardReplica:
    def __init__(self, spec: WorkerSpec) -> None:
        from worker.shard import ShardWorker  # torch: only in the replica's process

        self.worker = ShardWorker(spec)

    async def channel(self, channel_id: str) -> AsyncIterator[list[Delta]]:
        async for batch in self.worker.channel(channel_id):
            yield batch

    async def start(self, channel_id: str, call: WorkerCall) -> Delta | None:
        return await self.worker.start(channel_id, call)

    def cancel(self, channel_id: str, request_id: str) -> None:
        self.worker.cancel(channel_id, request_id)

    async def health(self) -> dict[str, Any]:
        return self.worker.health()

    async def sync(self, version: int, pins: dict[str, str]) -> dict[str, Any]:
        return await self.worker.sync(version, pins)

    async def metrics(self) -> str:
        return self.worker.metrics()

    def check_health(self) -> None:  # Serve restarts a replica whose engine thread died
        if not self.worker.loop.is_alive():
            raise RuntimeError("the engine loop stopped")


class ServePool:
    """The shard replicas behind their Serve handles: requests go over one channel per replica
    (gateway/channel.py), opened on first use and again after the replica failed."""

    def __init__(self, config: ServeConfig, handles: dict[str, Any]) -> None:
        self.handles = handles
        self.replicas = replica_infos(config)
        self._channels: dict[str, ReplicaChannel] = {}

    def _channel(self, replica_id: str) -> ReplicaChannel:
        channel = self._channels.get(replica_id)
        if channel is None or channel.failure is not None:
            handle = self.handles[replica_id]
            channel = self._channels[replica_id] = ReplicaChannel(
                lambda channel_id: handle.options(stream=True).channel.remote(channel_id),
                lambda channel_id, call: handle.start.remote(channel_id, call),
                lambda channel_id, request_id: handle.cancel.remote(channel_id, request_id),
            )
        return channel

    def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        return self._channel(replica_id).stream(call)

    async def health(self, replica_id: str) -> dict[str, Any]:
        return await self.handles[replica_id].health.remote()

    async def sync(self, replica_id: str, version: int, pins: dict[str, str]) -> dict[str, Any]:
        return await self.handles[replica_id].sync.remote(version, pins)

    async def metrics(self, replica_id: str) -> str:
        return await self.handles[replica_id].metrics.remote()


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(_build_app)
class GatewayIngress:
    def __init__(self, config: dict[str, Any], handles: dict[str, Any]) -> None:
        from gateway.catalog import Catalog
        from gateway.dispatch import Gateway

        parsed = ServeConfig.model_validate(config)
        import gateway.api.app as api

        api.set_process_gateway(Gateway(parsed, Catalog(parsed), ServePool(parsed, handles), _rate_limiter(parsed)))
        self.listener = None
        if parsed.http.listener == "gateway":  # this replica serves HTTP itself (Serve's proxies are off)
            from gateway.listener import Listener

            self.listener = Listener(api.create_app(api.process_gateway), parsed.http.host, parsed.http.port)

    def check_health(self) -> None:  # Serve restarts a gateway whose listener stopped
        failure = self.listener.failure() if self.listener is not None else None
        if failure is not None:
            raise RuntimeError(f"the gateway's HTTP listener stopped: {failure}")


def _rate_limiter(config: ServeConfig) -> RateLimiter:
    """Rate limits in the deployment's Redis (an asyncio client), or per process without one.
    An unreachable Redis is found on first use: limits then count per process for a while."""
    from gateway.ratelimit import RateLimiter

    redis = config.cache.redis
    if redis is None:
        return RateLimiter()
    from cache.l2 import connect

    return RateLimiter(connect(redis, is_async=True), redis.key_prefix)


def replica_threads(config: ServeConfig) -> int:
    """CPU replicas share the machine's cores (the config's device.threads, when set, wins)."""
    cpu_replicas = sum(s.replicas for s in config.shards if s.num_gpus == 0)
    return max(1, (os.cpu_count() or 1) // max(cpu_replicas, 1))


def build(config: ServeConfig) -> serve.Application:
    threads = replica_threads(config)
    shards = {s.name: s for s in config.shards}
    specs = {s.name: config.worker_spec(s.name, threads=threads) for s in config.shards}
    handles = {
        r.replica_id: ShardReplica.options(
            name=f"shard-{r.replica_id}", num_replicas=1, max_ongoing_requests=max(64, 4 * config.engine.num_seq_slots),
            ray_actor_options={"num_cpus": shards[r.shard].num_cpus, "num_gpus": shards[r.shard].num_gpus},
        ).bind(specs[r.shard])
        for r in replica_infos(config)
    }
    return GatewayIngress.options(name="gateway", num_replicas=config.http.gateway_replicas,
                                  ray_actor_options={"num_cpus": 0}).bind(config.model_dump(), handles)


def _show_progress(deployer: threading.Thread, started: float, stop: threading.Event) -> None:
    """Each deployment's state as it changes (replicas load the model), until serve.run returns
    or `stop` is set."""
    shown: dict[str, str] = {}
    while deployer.is_alive() and not stop.is_set():
        deployer.join(1.0)
        try:
            app_status = serve.status().applications.get("loraplex")
        except Exception:  # noqa: BLE001, S112 - the controller may still be starting
            continue
        for name, dep in sorted((app_status.deployments if app_status else {}).items()):
            status = str(dep.status.value)
            state = {"UPDATING": "loading", "HEALTHY": "ready", "UNHEALTHY": "failed"}.get(status, status.lower())
            if shown.get(name) != state:
                shown[name] = state
                detail = f": {dep.message}" if state == "failed" and dep.message else ""
                print(f"  {name}: {state} ({time.perf_counter() - started:.0f} s){detail}", file=sys.stderr, flush=True)


def app_from_config(args: dict[str, Any]) -> serve.Application:
    """The application builder a RayService's serveConfigV2 names (`import_path:
    gateway.serve:app_from_config`, `args: {config: ..., base_dir: ...}`): the same
    `build` as `loraplex serve`, from the same config."""
    if not isinstance(args, dict) or not isinstance(args.get("config"), dict):
        raise ConfigError("serveConfigV2 args need 'config': the loraplex config mapping")
    return build(parse_config(args["config"], args.get("base_dir", "."), "serveConfigV2 args.config"))


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
        updates = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if updates:
            config = config.model_copy(update={"http": config.http.model_copy(update=updates)})
        from gateway.catalog import Catalog

        print(f"loraplex: checking {config.model or 'the default model'} and {len(config.adapters)} adapter(s)...",
              file=sys.stderr, flush=True)
        catalog = Catalog(config)  # a bad model or adapter file stops here, before Ray starts
    except (ConfigError, ValueError, OSError) as e:
        print(f"loraplex serve: {e}", file=sys.stderr)
        return 2
    for name, value in SERVE_ENV.items():  # Ray's processes inherit them; a user's own setting wins
        os.environ.setdefault(name, value)
    import ray

    print("loraplex: starting a local Ray...", file=sys.stderr, flush=True)
    ray.init(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=args.verbose, configure_logging=True)
    # Ctrl-C or SIGTERM from here on, while deploying too, stops Serve and Ray; handled the same whatever
    # the process inherited (started in the background by a script, SIGINT came ignored and a stop
    # sent while the replicas loaded was lost; SIGTERM killed the driver and left Ray running).
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if config.http.listener == "gateway":  # the gateway replicas listen on the port themselves
            serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        else:
            serve.start(http_options={"host": config.http.host, "port": config.http.port},
                        logging_config={"log_level": "WARNING"})
        total = sum(s.replicas for s in config.shards)
        print(f"loraplex: deploying {catalog.model_name} on {total} shard replica(s): "
              + ", ".join(f"{s.name} [{', '.join(s.adapters) or 'base'}] x{s.replicas}" for s in config.shards)
              + " (each loads the model)...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        deploy_error: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(build(config), name="loraplex", route_prefix="/")
            except BaseException as e:  # noqa: BLE001 - shown below; the main thread decides
                deploy_error.append(e)

        deployer = threading.Thread(target=deploy, daemon=True)
        deployer.start()
        _show_progress(deployer, started, stop)
        if stop.is_set():
            print("loraplex: stopped while deploying; shutting down...", file=sys.stderr, flush=True)
            return 130
        if deploy_error:
            print(f"loraplex serve: deployment failed: {deploy_error[0]}", file=sys.stderr)
            return 1
        url = f"http://{config.http.host}:{config.http.port}"
        print(f"loraplex: ready in {time.perf_counter() - started:.0f} s at {url}  (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        key = " -H 'Authorization: Bearer YOUR_KEY'" if config.tenants else ""
        example_model = config.adapters[0].name if config.adapters else catalog.model_name
        print(f"  curl {url}/v1/chat/completions{key} -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{example_model}\", "
              f"\"messages\": [{{\"role\": \"user\", \"content\": \"What is copper?\"}}]}}'",
              file=sys.stderr, flush=True)
        # a timed wait: Python runs a handler in the main thread, when it next runs bytecode; a signal
        # the kernel hands to one of Ray's threads does not wake an untimed wait
        while not stop.wait(SIGNAL_CHECK_S):
            pass
        print("loraplex: shutting down...", file=sys.stderr, flush=True)
    finally:
        if not _within(serve.shutdown, SERVE_SHUTDOWN_TIMEOUT_S):
            print(f"loraplex: Serve did not shut down within {SERVE_SHUTDOWN_TIMEOUT_S:g} s; stopping Ray",
                  file=sys.stderr, flush=True)
        ray.shutdown()
    return 0


def _within(fn: Callable[[], object], timeout_s: float) -> bool:
    """Run `fn` on a daemon thread; False when it has not returned within `timeout_s` (Serve's
    shutdown waits forever on a controller that was killed before it answered; Ray's own
    shutdown, next, stops the processes it started either way). Its exception is raised here."""
    failed: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(e)

    worker = threading.Thread(target=call, name="loraplex-serve-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if failed:
        raise failed[0]
    return not worker.is_alive()
