"""`loraplex serve` (torch-free until a replica loads): check the config and the model, join the Ray
cluster at `--ray-address` or `RAY_ADDRESS` or start a local Ray of its own, deploy the application
gateway/serve.py builds, and serve until Ctrl-C or SIGTERM. Stopping, it deletes its application
(each gateway replica stops taking HTTP requests and lets those in flight finish, so the shard
replicas have nothing left to wait for), then stops the Ray it started, or leaves the cluster it
joined running.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import ray
from ray import serve
from ray.serve.exceptions import RayServeException

from gateway.cluster.ray_nodes import JoinError, alive_nodes, call_within, connect, ray_address
from gateway.config import ConfigError, ServeConfig, ShardConfig, load_config
from gateway.serve import APP_NAME, SERVE_ENV, STOP_POLL_S, build
from gateway.state import StateStoreRefused, check_now

if TYPE_CHECKING:
    from gateway.catalog import Catalog

SIGNAL_CHECK_S = 0.2  # how often the main thread looks for a Ctrl-C or SIGTERM


DEPLOY_POLL_S = 1.0  # how often deploying shows the deployments' states


APP_DELETE_TIMEOUT_S = 30.0  # `loraplex serve` waits this long for its application to go, then stops anyway


SERVE_SHUTDOWN_TIMEOUT_S = 15.0  # ... and for Serve's controller, where it stops Serve on a joined cluster


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
    total = sum(s.autoscaling.min_replicas if s.autoscaling else s.replicas for s in config.shards)

    def count(shard: ShardConfig) -> str:
        scaling = shard.autoscaling
        return f"x{shard.replicas}" if scaling is None else f"x{scaling.min_replicas}..{scaling.max_replicas} (autoscaled)"

    print(f"loraplex: deploying {catalog.model_name} on {total} shard replica(s): "
          + ", ".join(f"{s.name} [{', '.join(s.adapters) or 'base'}] {count(s)}" for s in config.shards)
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
