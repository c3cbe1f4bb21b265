"""The chart's Ray cluster: GCS fault tolerance on an external Redis (the state store by default), and
the gateway replica on the head, where a worker pod that dies cannot take it."""

from __future__ import annotations

import helm_python as helm
import pytest

from gateway.config import parse_config
from tests.deploy.test_helm import CHART, KEYED, config_in_pod, lint, multi_shard_values, render, serve_config


def ray_cluster(values: dict) -> dict:
    return next(d for d in render(values) if d["kind"] == "RayService")["spec"]["rayClusterConfig"]


def test_gcs_fault_tolerance_keeps_the_heads_tables_in_the_state_store() -> None:
    lint(KEYED)
    options = ray_cluster(KEYED)["gcsFaultToleranceOptions"]
    assert options == {"redisAddress": "lp-loraplex-state:6379",
                       "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "lp-loraplex-state", "key": "password"}}}}
    plain = {**KEYED, "state": {"auth": {"enabled": False}}}
    assert "redisPassword" not in ray_cluster(plain)["gcsFaultToleranceOptions"]


def test_gcs_fault_tolerance_on_an_external_state_store_another_redis_or_none() -> None:
    external = {**KEYED, "state": {"enabled": False, "external": {"url": "redis://:pw@state.internal:6380/2",
                                                                  "passwordSecret": "state-auth"}}}
    options = ray_cluster(external)["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "state.internal:6380"  # no scheme, password or database: Ray's host:port
    assert options["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "state-auth"
    own = {**KEYED, "ray": {"gcsFaultTolerance": {"redisAddress": "gcs:6379", "passwordSecret": "gcs-auth"}}}
    assert ray_cluster(own)["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"]["name"] == "gcs-auth"
    assert "gcsFaultToleranceOptions" not in ray_cluster({**KEYED, "ray": {"gcsFaultTolerance": {"enabled": False}}})


@pytest.mark.parametrize("url", ["rediss://state.internal:6380", "redis://state.internal:6380"])
def test_a_state_store_the_gcs_cannot_use_is_refused_by_name(url) -> None:
    cluster = url.startswith("redis://")
    values = {**KEYED, "state": {"enabled": False, "external": {"url": url, "cluster": cluster}}}
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmError, match="ray.gcsFaultTolerance.redisAddress"):
        chart.render(values, name="lp", namespace="serving", is_install=True)
    values["ray"] = {"gcsFaultTolerance": {"redisAddress": "not a host"}}
    with pytest.raises(helm.HelmError, match="redisAddress"):
        chart.render(values, name="lp", namespace="serving", is_install=True)


def test_the_one_gateway_goes_on_the_head_by_a_ray_label(tmp_path) -> None:
    cluster = ray_cluster(KEYED)
    assert cluster["headGroupSpec"]["rayStartParams"]["labels"] == "loraplex.io/ingress=yes"
    assert "labels" not in cluster["workerGroupSpecs"][0]["rayStartParams"]
    parsed = parse_config(config_in_pod(render(KEYED), tmp_path), ".", "serveConfigV2")
    assert parsed.http.node_labels == {"loraplex.io/ingress": "yes"}
    theirs = {**KEYED, "ray": {"head": {"rayStartParams": {"num-cpus": "0", "labels": "zone=a"}}}}
    assert ray_cluster(theirs)["headGroupSpec"]["rayStartParams"]["labels"] == "zone=a,loraplex.io/ingress=yes"


@pytest.mark.parametrize("http", [{"gateway_replicas": 2}, {"node_labels": {"pool": "edge"}}])
def test_several_gateways_or_the_users_own_nodes_are_left_where_the_user_says(http) -> None:
    values = multi_shard_values()
    values["loraplex"]["http"] = http
    docs = render(values)
    service = next(d for d in docs if d["kind"] == "RayService")
    assert "labels" not in service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert serve_config(service)["http"].get("node_labels") == http.get("node_labels")
