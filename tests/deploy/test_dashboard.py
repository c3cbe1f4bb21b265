"""The chart's Grafana dashboard: shipped as a ConfigMap Grafana's sidecar loads (on by default),
and every metric its panels query is one that /metrics exposes (checked statically, from the
metric families the gateway and its workers render; bench/dashboard_check.py runs the queries
against a real Prometheus)."""

from __future__ import annotations

import json

import kubernetes_validate
from prometheus_client.parser import text_string_to_metric_families

from bench.dashboard_check import DASHBOARD, metric_names, panel_queries
from cache.stats import CacheStats, prometheus_text
from gateway.metrics import GatewayMetrics
from tests.deploy.test_helm import KUBE_VERSION, lint, render
from worker.engine.outputs import EngineCounters

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exposed_names() -> set[str]:
    """The sample names /metrics may show: the gateway's families (with or without samples yet),
    the workers' prefix-cache and engine families."""
    texts = [GatewayMetrics().render(), EngineCounters().prometheus(),
             prometheus_text(CacheStats(), l1_bytes=0, redis_state="off", redis_errors=0, redis_round_trips=0)]
    names = set()
    for family in (f for text in texts for f in text_string_to_metric_families(text)):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def test_every_panel_queries_only_metrics_that_metrics_exposes() -> None:
    queries = panel_queries(json.loads(DASHBOARD.read_text()))
    exposed = exposed_names()
    assert "loraplex_gateway_itl_seconds_bucket" in exposed and "loraplex_cache_hit_chunks_total" in exposed
    unknown = {(title, name) for title, expr in queries for name in metric_names(expr) if name not in exposed}
    assert not unknown
    queried = {name for _, expr in queries for name in metric_names(expr)}
    for needed in ("loraplex_gateway_requests_total", "loraplex_gateway_in_flight", "loraplex_gateway_queue_seconds_bucket",
                   "loraplex_gateway_ttft_seconds_bucket", "loraplex_gateway_itl_seconds_bucket", "loraplex_cache_lookup_hits_total"):
        assert needed in queried


def test_every_panel_has_a_unique_id_and_the_prometheus_data_source_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == ("datasource", "datasource", "prometheus")
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]


def test_the_dashboard_ships_as_a_configmap_the_grafana_sidecar_loads() -> None:
    configmaps = [d for d in render() if d["kind"] == "ConfigMap"]
    (dashboard,) = [d for d in configmaps if d["metadata"]["name"] == "lp-loraplex-dashboard"]
    kubernetes_validate.validate(dashboard, KUBE_VERSION, strict=True)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1" and dashboard["metadata"]["namespace"] == "serving"
    assert json.loads(dashboard["data"]["loraplex.json"]) == json.loads(DASHBOARD.read_text())


def test_the_dashboard_follows_its_values_and_can_be_turned_off() -> None:
    values = {"grafanaDashboard": {"label": "dashboards", "labelValue": "loraplex", "namespace": "monitoring",
                                   "annotations": {"grafana_folder": "LLM serving"}}}
    lint(values)
    (dashboard,) = [d for d in render(values) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "lp-loraplex-dashboard"]
    assert dashboard["metadata"]["labels"]["dashboards"] == "loraplex" and "grafana_dashboard" not in dashboard["metadata"]["labels"]
    assert dashboard["metadata"]["namespace"] == "monitoring" and dashboard["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}
    assert not [d for d in render({"grafanaDashboard": {"enabled": False}}) if d["metadata"]["name"] == "lp-loraplex-dashboard"]

