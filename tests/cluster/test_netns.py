"""The multi-node tests' network (bench/cluster/netns.py): a network that a killed run left on the
same subnet, with nothing running in it, is cleared by the next; one still in use is refused."""

from __future__ import annotations

import subprocess
import time

import pytest

from bench.cluster import netns

SUBNET = "10.79.0"


def test_a_network_left_by_a_killed_run_is_cleared_and_one_in_use_is_refused(tmp_path) -> None:
    missing = netns.available()
    assert missing is None, missing  # CI runs as root: this test must run, never skip
    left = netns.Network(tmp_path / "left", SUBNET)  # never closed: the run that made it was killed
    left.add_host("n1")
    network = netns.Network(tmp_path / "next", SUBNET)
    try:
        host = network.add_host("n1")
        assert subprocess.run(["ip", "link", "show", left.bridge], capture_output=True).returncode != 0
        assert left.hosts["n1"].name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        busy = subprocess.Popen(["ip", "netns", "exec", host.name, "sleep", "30"])
        try:
            time.sleep(0.3)
            with pytest.raises(RuntimeError, match=f"{SUBNET}.1 is already on {network.bridge}.*processes run in"):
                netns.Network(tmp_path / "third", SUBNET)
        finally:
            busy.kill()
            busy.wait()
    finally:
        network.close()
