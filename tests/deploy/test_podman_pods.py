"""deploy/podman_pods.py without podman: the order a pod is killed in (the pods themselves run in
tests/deploy/test_local_kube.py)."""

from __future__ import annotations

import deploy.podman_pods as podman_pods
from tests.deploy.test_kube_pods import HEAD, pods_of


def test_a_pod_is_killed_as_a_kubelet_kills_it_containers_then_its_sandbox(tmp_path, monkeypatch) -> None:
    # `podman pod kill` signals the infra container with the rest: when its network goes first, the
    # clients of the dying processes get no FIN and wait out their timeouts
    calls: list[tuple[str, ...]] = []
    monkeypatch.setattr(podman_pods, "podman", lambda *args, **kw: calls.append(args))
    podman_pods.Cluster(pods_of(tmp_path), tmp_path).kill(HEAD)
    assert calls == [("kill", "--signal", "KILL", f"{HEAD}-ray-head"), ("wait", f"{HEAD}-ray-head"), ("pod", "kill", HEAD)]
