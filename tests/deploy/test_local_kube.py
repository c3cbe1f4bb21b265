"""deploy/local-kube.sh end to end: the images built, the chart's pods run in podman, used, and two
faults. Minutes of building and running, so only where asked for: LORAPLEX_CONTAINER_TESTS=1 (as
root, with podman, runc and debootstrap installed; `.ci/run` leaves it out and says so)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.deploy.test_helm import ROOT

pytestmark = pytest.mark.skipif(
    os.environ.get("LORAPLEX_CONTAINER_TESTS") != "1" or shutil.which("podman") is None or os.geteuid() != 0,
    reason="container test: set LORAPLEX_CONTAINER_TESTS=1, as root with podman")


def test_the_charts_pods_run_serve_and_survive_a_worker_and_a_head_killed() -> None:
    done = subprocess.run([str(ROOT / "deploy" / "local-kube.sh")], capture_output=True, text=True, timeout=3600)
    lines = done.stdout.strip().splitlines()
    print(done.stdout[-6000:], done.stderr[-3000:])
    assert re.fullmatch(r"\d+ passed, 0 failed", lines[-1]), lines[-1]
    assert done.returncode == 0
    images = [line for line in lines if line.startswith("image: ")]
    assert {line.split()[1] for line in images} >= {"localhost/loraplex:0.1.0", "localhost/loraplex-redis:0.1.0"}
    assert "check: worker pod killed under load: 0 whole requests lost: ok" in done.stdout
    assert not subprocess.run(["podman", "pod", "ls", "-q"], capture_output=True, text=True,
                              env={**os.environ, "CONTAINERS_CONF": str(ROOT / "deploy" / "podman" / "containers.conf")}).stdout.strip()
