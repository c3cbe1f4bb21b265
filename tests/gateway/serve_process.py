"""`loraplex serve` as a user runs it: a subprocess on a written config, started until it
says it is ready, stopped with SIGINT (what Ctrl-C does) and required to exit cleanly."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.redis_server import free_port


@contextlib.contextmanager
def running_serve(config: dict, directory: Path, start_timeout_s: float = 240) -> Iterator[str]:
    """Yields the server's base URL; the server listens on a free local port."""
    port = free_port()
    config = {**config, "http": {**(config.get("http") or {}), "host": "127.0.0.1", "port": port}}
    path = directory / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + start_timeout_s
    output = []
    while True:
        line = process.stdout.readline()
        output.append(line)
        if "ready in" in line:
            break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail("loraplex serve did not start:\n" + "".join(output))
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(process.stdout), daemon=True)  # a full pipe would block the server
    drain.start()
    yield f"http://127.0.0.1:{port}"
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail("loraplex serve did not stop on SIGINT")
    drain.join(10)
    assert "shutting down" in "".join(rest) and process.returncode == 0
