"""`loraplex serve` stops on SIGTERM or Ctrl-C while its replicas are still loading, and takes
the local Ray it started with it (a Kubernetes pod or systemd stopping it early, a user who
changes their mind). Before, SIGTERM then killed the driver at once and left Ray's processes
running; a SIGINT that came in ignored (a server started in the background by a script) was lost."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from tests.redis_server import free_port


@pytest.mark.parametrize("how", ["sigterm", "sigint-ignored-at-start"])
def test_a_stop_while_deploying_shuts_everything_down(tmp_path, how) -> None:
    config = {"model": None, "adapters": [], "shards": [{"name": "base", "adapters": [], "replicas": 1}],
              "cache": {"redis_url": None}, "http": {"host": "127.0.0.1", "port": free_port()}}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
    if how == "sigint-ignored-at-start":  # as a shell starts a background job: SIGINT ignored across exec
        command = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    output = []
    try:
        for line in process.stdout:  # until Serve deploys: Ray and its processes are up, the replicas load
            output.append(line)
            if "deploying" in line or "ready in" in line:
                break
        assert "deploying" in "".join(output), "".join(output)
        ray_processes = psutil.Process(process.pid).children(recursive=True)
        assert ray_processes
        process.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        rest, _ = process.communicate(timeout=90)
        output.append(rest)
        assert process.returncode in (130, 0), "".join(output)
    finally:
        if process.poll() is None:
            process.kill()
    assert "shutting down" in "".join(output)
    deadline = time.monotonic() + 30
    while any(map(alive, ray_processes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(alive, ray_processes)), [p.pid for p in ray_processes if alive(p)]


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
