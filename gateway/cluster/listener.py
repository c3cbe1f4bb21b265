"""The gateway's own HTTP listener (`http.listener: gateway`, the default): uvicorn serves the
API in the ingress replica itself, on the configured port, on the event loop that also runs
the replica's handles to the shards (Ray-free, torch-free).

Behind Ray Serve's proxy every HTTP request is a Ray call from the proxy's process to the
gateway replica, and every SSE event a streamed item back, about a millisecond of CPU at each
end whatever its size: on 2 cores, with 8 streams, that was a third of what the serving path
cost beside the engine. Listening in the replica removes that hop and the proxy's process.
Ray Serve's own direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS) serves from the replica too,
but on ports it hands out from a range, for a load balancer in front: our users' clients
expect the one configured port. So the socket is ours, with SO_REUSEPORT: every gateway
replica on a node listens on the same port and the kernel spreads connections over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the replica's signals are Ray's, not the listener's
        yield


def open_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other gateway replicas on this machine may share. Raises
    OSError (with the address) when the port is taken by something else."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from e
    return sock


class Listener:
    """`app` served on host:port from the running event loop, until `stop()`."""

    def __init__(self, app, host: str, port: int) -> None:
        self.socket = open_socket(host, port)  # a taken port fails here, in the replica's constructor
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        self.server = _Server(config)
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.socket]))

    def failure(self) -> str | None:
        """Why the listener is not serving any more, or None while it is."""
        if not self.task.done():
            return None
        if self.task.cancelled():
            return "cancelled"
        error = self.task.exception()
        return f"{type(error).__name__}: {error}" if error is not None else "stopped"

    async def stop(self) -> None:
        self.server.should_exit = True
        await asyncio.wait_for(self.task, 10)
        self.socket.close()
