"""A worker pod's memory request against what its replicas are budgeted (docs/kubernetes.md#a-workers-memory):
the chart renders a request at least the sum of the config's budgets, and refuses one below it, or a
host tier with no budget at all."""

from __future__ import annotations

import re

import helm_python as helm
import pytest
import yaml

from gateway.config import parse_config
from tests.deploy.test_helm import CHART, KEYED, config_in_pod, lint, render

UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def quantity_bytes(quantity: str | int) -> int:
    number, unit = re.fullmatch(r"([0-9.eE]+?)([KMGT]i?|k)?", str(quantity)).groups()
    return int(float(number) * UNITS[unit or ""])


def worker_memory_bytes(docs: list[dict]) -> int:
    service = next(d for d in docs if d["kind"] == "RayService")
    container = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    return quantity_bytes(container["resources"]["requests"]["memory"])


def budget_bytes(values: dict, tmp_path) -> int:
    """What the config a pod reads budgets per replica, times the replicas on a pod (one per GPU)."""
    docs = render(values)
    residency = parse_config(config_in_pod(docs, tmp_path), ".", "serveConfigV2").residency
    worker = {**VALUES["ray"]["worker"], **values.get("ray", {}).get("worker", {})}
    per_replica = {**VALUES["ray"]["worker"]["memoryPerReplica"], **worker.get("memoryPerReplica", {})}
    is_cpu = not worker["gpusPerPod"]
    each = sum(per_replica.values()) + (residency.host_bytes or 0) + ((residency.device_bytes or 0) if is_cpu else 0)
    return each * max(1, worker["gpusPerPod"])


TIERED = {"device_adapters": 64, "host_bytes": 6 << 30, "disk_bytes": 100 << 30}


@pytest.mark.parametrize("values", [
    KEYED,
    {**KEYED, "loraplex": {"residency": TIERED}},
    {**KEYED, "loraplex": {"residency": {"device_bytes": 3 << 30, "host_bytes": 2 << 30}},
     "ray": {"worker": {"gpusPerPod": 0, "resources": {"requests": {"cpu": "8", "memory": "12Gi"}}}}},
    {**KEYED, "loraplex": {"residency": TIERED},
     "ray": {"worker": {"gpusPerPod": 2, "resources": {"requests": {"cpu": "8", "memory": "30000Mi"}}}}},
], ids=["default", "gpu-tiers", "cpu-tiers", "two-gpus"])
def test_the_rendered_worker_memory_request_covers_its_replicas_budgets(values, tmp_path) -> None:
    lint(values)
    requested, budget = worker_memory_bytes(render(values)), budget_bytes(values, tmp_path)
    assert requested >= budget > 0
    if values is not KEYED:  # the host tier counts: the budget grows with it
        assert budget >= (2 << 30) + VALUES["ray"]["worker"]["memoryPerReplica"]["overheadBytes"]


def _refused(values: dict, match: str) -> None:
    with pytest.raises(helm.HelmError, match=match):
        helm.Chart.load(str(CHART)).render(values, name="lp", namespace="serving", is_install=True)


def test_a_request_below_the_budgets_or_a_host_tier_without_one_is_refused(tmp_path) -> None:
    big_host = {**KEYED, "loraplex": {"residency": {**TIERED, "host_bytes": 14 << 30}}}  # 14 + 6 GiB > 16Gi
    _refused(big_host, "below the 21474836480 bytes")
    two_gpus = {**KEYED, "loraplex": {"residency": TIERED}, "ray": {"worker": {"gpusPerPod": 2}}}  # 2 x 12 GiB > 16Gi
    _refused(two_gpus, "below the")
    _refused({**KEYED, "loraplex": {"residency": {"device_adapters": 8}}}, "host_bytes")
    _refused({**KEYED, "ray": {"worker": {"resources": {"requests": {"cpu": "4", "memory": "lots"}}}}}, "not a memory quantity")
    just_enough = {**big_host, "ray": {"worker": {"resources": {"requests": {"cpu": "4", "memory": "20Gi"}}}}}
    assert worker_memory_bytes(render(just_enough)) == budget_bytes(just_enough, tmp_path) == 20 << 30
