"""`loraplex serve` as a user runs it: a subprocess on a written config, started until it
says it is ready, stopped with SIGINT (what Ctrl-C does) and required to exit cleanly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.server import ServeFailed, Server
from tests.redis_server import free_port


@contextlib.contextmanager
def running_serve(config: dict, directory: Path, start_timeout_s: float = 240) -> Iterator[str]:
    """Yields the server's base URL; the server listens on a free local port. It must stop on Ctrl-C."""
    port = free_port()
    config = {**config, "http": {**(config.get("http") or {}), "host": "127.0.0.1", "port": port}}
    try:
        server = Server(config, directory, port, start_timeout_s)
    except ServeFailed as e:
        pytest.fail(str(e))
    try:
        yield server.url
    except BaseException:  # the test failed: the server goes all the same (its Ray would outlive the run)
        server.stop(60)  # as Ctrl-C does, or killed with everything it started
        raise
    if not server.stop(60):
        pytest.fail("loraplex serve did not stop on SIGINT")
    assert "shutting down" in "".join(server.output) and server.process.returncode == 0
