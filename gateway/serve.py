"""Ray Serve wiring (the only module that imports ray.serve) and `loraplex serve`.

Every replica of every shard is its own Serve deployment (`shard-<shard>-<i>`,
one replica each, one device each) so that the gateway, not Serve's router,
chooses the replica a request goes to (docs/architecture.md#routing-and-placement); Serve restarts a replica that
dies. The gateway is the ingress deployment: the FastAPI app of gateway/api/app.py
holding a handle to every shard replica; responses stream through the handles. Each
gateway replica listens on the HTTP port itself (gateway/cluster/listener.py), or, with
`http.listener: serve-proxy`, Serve's proxies take HTTP and call the gateway replicas.

`loraplex serve` joins the Ray cluster at `--ray-address` or `RAY_ADDRESS`, or starts a local
Ray of its own. Stopping (Ctrl-C, SIGTERM), it deletes its application: each gateway replica
stops taking HTTP requests, lets those in flight finish (within its listener's grace), and ends
its channels, so the shard replicas have nothing left to wait for; then it stops the Ray it
started, or leaves the cluster it joined running.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from gateway.cluster.channel import Channels, ReplicaChannel
from gateway.cluster.pool import WorkerFailed, replica_infos
from gateway.cluster.ray_nodes import JoinError, alive_nodes, call_within, connect, ray_address, this_node
from gateway.config import ConfigError, ServeConfig, ShardConfig, load_config, parse_config
from gateway.policy.nodes import Node, ReplicaDemand, node_options, spread
from gateway.state import StateStoreRefused, check_now
from worker.contract.calls import Delta, WorkerCall
from worker.contract.spec import WorkerSpec

if TYPE_CHECKING:
    from gateway.catalog import Catalog

log = logging.getLogger(__name__)

APP_NAME = "loraplex"
SIGNAL_CHECK_S = 0.2  # how often the main thread looks for a Ctrl-C or SIGTERM
DEPLOY_POLL_S = 1.0  # how often deploying shows the deployments' states
# Stopping. A stopping replica looks this often whether its requests are done (Serve's default: 2 s,
# which made each step of a stop wait whole seconds); Serve kills a replica not stopped in its timeout:
# a gateway's covers its listener's grace for HTTP requests in flight (gateway/cluster/listener.py, 5 s); a shard
# replica's requests end with the gateways' channels, so its own timeout only matters when a gateway died.
STOP_POLL_S = 0.2
GATEWAY_STOP_TIMEOUT_S = 15.0
SHARD_STOP_TIMEOUT_S = 20.0
APP_DELETE_TIMEOUT_S = 30.0  # `loraplex serve` waits this long for its application to go, then stops anyway
SERVE_SHUTDOWN_TIMEOUT_S = 15.0  # ... and for Serve's controller, where it stops Serve on a joined cluster

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

    def check_health(self) -> None:  # Serve restarts a replica whose engine thread died
        if not self.worker.loop.is_alive():
            raise RuntimeError("the engine loop stopped")


class ServePool:
    """The shard replicas behind their Serve handles: requests go over one channel per replica
    (gateway/cluster/channel.py), opened on first use and again after the replica failed."""

    def __init__(self, config: ServeConfig, handles: dict[str, Any]) -> None:
        self.handles = handles
        self.replicas = replica_infos(config)
        self._unresponsive_after_s = config.routing.unresponsive_after_s
        self.channels = Channels(self._open_channel)
        self._streams: dict[str, Any] = {}  # each replica's latest channel stream (a DeploymentResponseGenerator)

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

    def is_reachable(self, replica_id: str) -> bool:
        return self.channels.is_reachable(replica_id)

    def stream(self, replica_id: str, call: WorkerCall) -> AsyncIterator[Delta]:
        return self.channels.get(replica_id).stream(call)

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
        from gateway.compose import Gateway
        from gateway.tenancy.ratelimit import open_rate_limiter

        parsed = ServeConfig.model_validate(config)
        import gateway.api.app as api

        self.pool = ServePool(parsed, handles)
        limiter = open_rate_limiter(parsed.state_redis(), parsed.http.gateway_replicas)
        api.set_process_gateway(Gateway(parsed, Catalog(parsed), self.pool, limiter))
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
            name=f"shard-{r.replica_id}", num_replicas=1, max_ongoing_requests=max(64, 4 * config.engine.num_seq_slots),
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


def _deploy(config: ServeConfig, stop: threading.Event) -> str | None:
    """Deploy the application and show each deployment's state as it changes (replicas load the
    model) until it runs: None, or why it does not ("stopped" when `stop` was set)."""
    started = time.perf_counter()
    try:  # submitted here, in the main thread: a stop from now on finds it there to delete
        serve.run_many([serve.RunTarget(build(config, alive_nodes()), name=APP_NAME, route_prefix="/")],
                       wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)
    except (RayServeException, ValueError, TypeError) as e:  # options Serve refuses
        return f"{type(e).__name__}: {e}"
    shown: dict[str, str] = {}
    while not stop.wait(DEPLOY_POLL_S):
        app = serve.status().applications.get(APP_NAME)
        for name, dep in sorted((app.deployments if app else {}).items()):
            status = str(dep.status.value)
            state = {"UPDATING": "loading", "HEALTHY": "ready", "UNHEALTHY": "failed"}.get(status, status.lower())
            if shown.get(name) != state:
                shown[name] = state
                detail = f": {dep.message}" if state == "failed" and dep.message else ""
                print(f"  {name}: {state} ({time.perf_counter() - started:.0f} s){detail}", file=sys.stderr, flush=True)
        if app is not None and app.status == "RUNNING":
            return None
        if app is not None and app.status == "DEPLOY_FAILED":
            return app.message or "a deployment failed"
    return "stopped"


def _delete_app() -> None:
    """Delete the application and wait until it is gone: its replicas drain (the module's docstring)."""
    serve.delete(APP_NAME, _blocking=False)
    while APP_NAME in serve.status().applications:
        time.sleep(STOP_POLL_S)


def _shutdown_serve() -> None:
    """serve.shutdown(), less Ray's "graceful_shutdown failed ... infinite retries" line: that call
    waits on the controller until the controller's own exit kills the call, which Ray then retries
    (and says so). Here the controller is told to stop without a call waiting on it, and is waited
    for until it is gone."""
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.graceful_shutdown.remote(wait=False))
    while True:
        try:
            ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        except ValueError:  # no actor of that name: it has exited
            return
        time.sleep(STOP_POLL_S)


def _stop(*, is_deployed: bool, is_joined: bool, was_serve_idle: bool) -> None:
    """Delete the application (when it was deployed), then: a local Ray, all of it stops; a joined
    cluster runs on, and so does Serve on it unless it ran no application before ours and runs none
    now (its controller then goes too: the next user's options apply). Bounded: each wait has its
    timeout, and Ray stops (or the driver disconnects) whatever happened before."""
    try:
        if is_deployed and not call_within(_delete_app, APP_DELETE_TIMEOUT_S):
            print(f"loraplex: the application was not deleted within {APP_DELETE_TIMEOUT_S:g} s", file=sys.stderr, flush=True)
        if is_joined and was_serve_idle and not serve.status().applications:
            if not call_within(_shutdown_serve, SERVE_SHUTDOWN_TIMEOUT_S):
                print(f"loraplex: Serve did not shut down within {SERVE_SHUTDOWN_TIMEOUT_S:g} s", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - reported; Ray is stopped (or left) below all the same
        print(f"loraplex: stopping Serve failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()  # a local Ray: every process of it; a joined cluster: this driver's connection only


def run(args: argparse.Namespace) -> int:
    """`loraplex serve`: check the config and the model, join or start Ray, deploy, and serve until
    Ctrl-C or SIGTERM; the exit code says how it ended."""
    checked = _checked(args)
    if isinstance(checked, int):
        return checked
    config, catalog = checked
    for name, value in SERVE_ENV.items():  # a local Ray's processes inherit them (a cluster's nodes set their own)
        os.environ.setdefault(name, value)
    address = ray_address(args.ray_address, os.environ)
    print(f"loraplex: joining the Ray cluster at {address}..." if address else "loraplex: starting a local Ray...",
          file=sys.stderr, flush=True)
    try:
        connect(address, is_verbose=args.verbose)
    except JoinError as e:
        print(f"loraplex serve: {e}", file=sys.stderr)
        return 1
    # Ctrl-C or SIGTERM from here on, while deploying too, stops Serve and Ray, whatever the process
    # inherited (a script that starts it in the background leaves SIGINT ignored)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    running_apps: set[str] = set()
    is_deployed = False
    try:
        running_apps = set(serve.status().applications)  # on a cluster joined: another's apps are left alone
        if APP_NAME in running_apps:
            print(f"loraplex serve: the cluster already runs an application named {APP_NAME!r} (another loraplex serve?): "
                  "deploying would replace it", file=sys.stderr)
            return 1
        is_deployed = True
        return _deploy_and_wait(config, catalog, stop)
    finally:
        _stop(is_deployed=is_deployed, is_joined=address is not None, was_serve_idle=not running_apps)


def _checked(args: argparse.Namespace) -> tuple[ServeConfig, Catalog] | int:
    """The config with the command line's overrides, checked, and its model and adapters read (a bad
    file stops here, before Ray starts); or the exit code of a refusal."""
    try:
        config = load_config(args.config)
        updates = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        if getattr(args, "allow_insecure_bind", False):
            updates["allow_insecure_bind"] = True
        if updates:
            config = config.model_copy(update={"http": config.http.model_copy(update=updates)})
        exposed = config.exposure_error()  # the config was checked as written; --host may move it
        if exposed is not None:
            raise ConfigError(exposed)
        unreachable = check_now(config.state, config.state_redis())  # a store that may lose state: refused here
        if unreachable is not None:
            print(f"loraplex: {unreachable}", file=sys.stderr, flush=True)
        from gateway.catalog import Catalog

        print(f"loraplex: checking {config.model or 'the default model'} and {len(config.adapters)} adapter(s)...",
              file=sys.stderr, flush=True)
        return config, Catalog(config)
    except (ConfigError, ValueError, OSError, StateStoreRefused) as e:
        print(f"loraplex serve: {e}", file=sys.stderr)
        return 2


def _deploy_and_wait(config: ServeConfig, catalog: Catalog, stop: threading.Event) -> int:
    """Start Serve, deploy the shards and the gateway, say how to reach them, and wait for `stop`."""
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
    failure = _deploy(config, stop)
    if failure == "stopped":
        print("loraplex: stopped while deploying; shutting down...", file=sys.stderr, flush=True)
        return 130
    if failure is not None:
        print(f"loraplex serve: deployment failed: {failure}", file=sys.stderr)
        return 1
    _say_ready(config, catalog, time.perf_counter() - started)
    # a timed wait: Python runs a handler in the main thread, when it next runs bytecode; a signal
    # the kernel hands to one of Ray's threads does not wake an untimed wait
    while not stop.wait(SIGNAL_CHECK_S):
        pass
    print("loraplex: shutting down...", file=sys.stderr, flush=True)
    return 0


def _say_ready(config: ServeConfig, catalog: Catalog, took_s: float) -> None:
    url = f"http://{config.http.host}:{config.http.port}"
    print(f"loraplex: ready in {took_s:.0f} s at {url}  (Ctrl-C stops)", file=sys.stderr, flush=True)
    key = " -H 'Authorization: Bearer YOUR_KEY'" if config.tenants else ""
    example_model = config.adapters[0].name if config.adapters else catalog.model_name
    print(f"  curl {url}/v1/chat/completions{key} -H 'Content-Type: application/json' \\\n"
          f"    -d '{{\"model\": \"{example_model}\", "
          f"\"messages\": [{{\"role\": \"user\", \"content\": \"What is copper?\"}}]}}'",
          file=sys.stderr, flush=True)
