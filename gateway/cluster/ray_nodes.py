"""Where `loraplex serve` runs: the Ray cluster at an address it is given (`--ray-address`, or Ray's
own convention, RAY_ADDRESS), or a local Ray of its own; and that cluster's nodes, as the placement
of replicas (gateway/policy/nodes.py) and their health reports see them. (Ray itself, not Ray
Serve: that is gateway/serve.py's.)

Without an address it always starts its own: `ray.init()` with no address would join the
cluster an earlier `ray start` wrote to /tmp/ray/ray_current_cluster, and wait minutes on one
that has since died.

Ray 2.60 authenticates with a token: a local `ray.init()` turns it on (writing a token to
~/.ray/auth_token when there is none), and `ray start --head` turns it on when there is a token;
but a driver (or a `ray start --address`) given an address turns it on only with
RAY_AUTH_MODE=token, so such a cluster refuses it (after 20 s of retries). Joining, `loraplex serve` turns it on, as Ray does for
a cluster it finds by itself, when it has a token (RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH
names, or ~/.ray/auth_token); a cluster without authentication takes a driver that sends one.
RAY_AUTH_MODE, when set, decides instead.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Mapping

import ray

from gateway.policy.nodes import Node

JOIN_PROBE_TIMEOUT_S = 5.0  # an address where nothing answers within this is refused at once
HEAD_RESOURCE = "node:__internal_head__"  # the resource Ray gives the head node alone


class JoinError(RuntimeError):
    """The cluster at the address given cannot be joined; the message says why and what to try."""


def ray_address(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The cluster to join: the flag's, else RAY_ADDRESS; None: start a local Ray."""
    return flag or environ.get("RAY_ADDRESS") or None


def use_token_if_any() -> None:
    """Token authentication on for this process when RAY_AUTH_MODE is unset and a token is there:
    Ray's own rule for a local cluster, applied (after `import ray`, so through Ray's helper, which
    also refreshes the config Ray read at import). A Ray without token authentication: nothing."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:  # before Ray 2.5x: no tokens
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def check_reachable(address: str, timeout_s: float = JOIN_PROBE_TIMEOUT_S) -> None:
    """JoinError when nothing accepts a connection at `address` (host:port or ray://host:port);
    "auto" and addresses of other shapes are left to Ray."""
    parts = urllib.parse.urlsplit(address if "://" in address else f"//{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # not a port number
        return
    if host is None or port is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise JoinError(f"nothing answers at {address} ({e.strerror or e}): is the cluster's head running there?") from e


def connect(address: str | None, *, is_verbose: bool) -> None:
    """Join the cluster at `address`, or start a local Ray when it is None."""
    logs = {"logging_level": logging.WARNING, "log_to_driver": is_verbose, "configure_logging": True}
    if address is None:
        ray.init(address="local", include_dashboard=False, **logs)
        return
    check_reachable(address)
    use_token_if_any()
    try:
        ray.init(address=address, **logs)
    except ConnectionError as e:
        raise JoinError(f"cannot join the Ray cluster at {address}: {e}. A cluster with token authentication needs its "
                        "token here: RAY_AUTH_TOKEN, or ~/.ray/auth_token (`ray get-auth-token` on its head)") from e


def this_node() -> dict[str, str]:
    """The Ray node this process runs on (its id and IP): a replica's health says where it is."""
    return {"id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def alive_nodes() -> list[Node]:
    """The cluster's nodes now (none outside Ray: an application built there is placed by Ray alone)."""
    if not ray.is_initialized():
        return []
    return [Node(n["NodeID"], n.get("Resources", {}), n.get("Labels", {}), is_head=HEAD_RESOURCE in n.get("Resources", {}))
            for n in ray.nodes() if n.get("Alive")]


def call_within(fn: Callable[[], object], timeout_s: float) -> bool:
    """Run `fn` on a daemon thread; False when it has not returned within `timeout_s` (Serve's
    calls wait forever on a controller that was killed before it answered; Ray's own shutdown,
    next, stops the processes it started either way). Its exception is raised here."""
    failed: list[BaseException] = []

    def call() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            failed.append(e)

    worker = threading.Thread(target=call, name="loraplex-serve-stop", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if failed:
        raise failed[0]
    return not worker.is_alive()
