"""deploy/local-kube.sh end to end: the images built, the chart's pods run in podman, used, and two
faults. Minutes of building and running, so only where asked for: LORAPLEX_CONTAINER_TESTS=1 (as
root, with podman, runc and debootstrap installed; `.ci/run` leaves it out and says so). And the head
fault's figures from a load's records, without podman."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from deploy.local_kube import Load, in_flight_figure, recovery_figure
from tests.deploy.test_helm import ROOT

containers = pytest.mark.skipif(
    os.environ.get("LORAPLEX_CONTAINER_TESTS") != "1" or shutil.which("podman") is None or os.geteuid() != 0,
    reason="container test: set LORAPLEX_CONTAINER_TESTS=1, as root with podman")


@containers
def test_the_charts_pods_run_serve_and_survive_a_worker_and_a_head_killed() -> None:
    done = subprocess.run([str(ROOT / "deploy" / "local-kube.sh")], capture_output=True, text=True, timeout=3600)
    lines = done.stdout.strip().splitlines()
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[-1]), lines[-1]
    assert done.returncode == 0
    images = [line for line in lines if line.startswith("image: ")]
    assert {line.split()[1] for line in images} >= {"localhost/loraplex:0.1.0", "localhost/loraplex-redis:0.1.0"}
    assert "check: worker pod killed under load: 0 whole requests lost: ok" in done.stdout
    assert done.stdout.count("requests in flight failed fast, none hung: ok") == 2  # the head's proxy and a worker's
    assert not subprocess.run(["podman", "pod", "ls", "-q"], capture_output=True, text=True,
                              env={**os.environ, "CONTAINERS_CONF": str(ROOT / "deploy" / "podman" / "containers.conf")}).stdout.strip()


def test_the_head_faults_figures_tell_requests_that_failed_fast_from_those_that_hung() -> None:
    load = Load(gateway=None, clients=2, timeout_s=5)  # never entered: no threads, only the records
    killed, down, restarted = 100.0, 101.0, 103.0
    load.requests = [(98.0, 99.0, None), (99.5, 100.3, "RemoteProtocolError: Server disconnected"),
                     (99.8, 100.5, None),  # answered before the kill landed
                     (100.4, 100.5, "ConnectError: refused"), (101.5, 106.5, "ReadTimeout: timed out"),
                     (107.0, 117.0, "404 no route"), (117.5, 118.0, None), (118.0, 118.6, None)]
    text, fast = in_flight_figure(load, killed)
    assert fast and text == ("2 in flight at the kill, 1 lost (RemoteProtocolError): 1 failed fast (within 0.3 s of the kill), "
                             "0 hung to the 5 s timeout")
    text, answered = recovery_figure(load, killed, down, restarted)
    assert answered == 118.0
    assert text == ("first answer 18.0 s after the kill (15.0 s after the start), "
                    "3 tries failed before it (ConnectError 1, ReadTimeout 1, 404 1)")
    load.requests.append((99.9, 104.9, "ReadTimeout: timed out"))  # one that hung from the kill on
    assert in_flight_figure(load, killed)[1] is False
