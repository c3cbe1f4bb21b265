"""The Helm chart, rendered and linted offline (helm-python-sdk: Helm's Go SDK as a
library, no helm binary, no cluster), core manifests validated against Kubernetes'
schemas, and the RayService's serveConfigV2 checked against `loraplex serve`."""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from gateway.config import load_config, parse_config
from gateway.registry_settings import RegistrySettings
from gateway.requests.tracing import TracingSettings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "loraplex"
KUBE_VERSION = "1.30.0"
CORE_KINDS = {"Service", "StatefulSet", "Secret", "NetworkPolicy", "Ingress", "ConfigMap"}
KEYED = {"operator": {"key": "sk-ops"}}  # someone may call the deployment: the gateway refuses a config without keys


def render(values: dict | None = None) -> list[dict]:
    manifests = helm.Chart.load(str(CHART)).render(values, name="lp", namespace="serving", is_install=True)
    texts = [text for path, text in manifests.items() if path.endswith(".yaml") and text.strip()]
    return [doc for text in texts for doc in yaml.safe_load_all(text) if doc]


def serve_config(rayservice: dict) -> dict:
    """The loraplex config in a RayService's serveConfigV2."""
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]["config"]


def ray_pods(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])]


def by_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def mounted_files(docs: list[dict], pod: dict) -> dict[str, str]:
    """What a Ray pod reads from its mounted Secrets (the chart's own): {path: content}."""
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    files = {}
    for mount in pod["containers"][0]["volumeMounts"]:
        if mount["name"] in volumes:
            volume = volumes[mount["name"]]
            secret = secrets[volume["secretName"]]
            for item in volume["items"]:
                text = secret.get("stringData", {}).get(item["key"])
                files[f"{mount['mountPath']}/{item['path']}"] = (
                    text if text is not None else base64.b64decode(secret["data"][item["key"]]).decode())
    return files


def config_in_pod(docs: list[dict], tmp_path: Path) -> dict:
    """The RayService's config as a Ray pod has it: every file it names is mounted in every Ray pod
    (asserted), and is written under tmp_path with the mounted Secret's content, where the config now points."""
    service = next(d for d in docs if d["kind"] == "RayService")
    config = copy.deepcopy(serve_config(service))
    pods = [mounted_files(docs, pod) for pod in ray_pods(service)]
    for section, key in [(None, "tenants_file"), (None, "operator_key_file"), ("cache", "redis_password_file"),
                         ("state", "password_file")]:
        holder = config if section is None else config.get(section, {})
        path = holder.get(key)
        if path is None:
            continue
        assert all(path in files for files in pods), f"{key} {path} is not mounted in every Ray pod"
        local = tmp_path / path.lstrip("/")
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(pods[0][path])
        holder[key] = str(local)
    return config


def multi_shard_values() -> dict:
    """What a user of `loraplex plan --format helm-values` would install: several shards, tenants,
    external Redis (the cache's, and a Redis Cluster for the state) with passwords, ingress and monitoring on."""
    return {
        "loraplex": {
            "model": "base.gguf",
            "adapters": [{"name": f"a{i}", "path": f"adapters/a{i}.gguf"} for i in range(6)],
            "shards": [{"name": f"shard-{i}", "adapters": [f"a{(i + j) % 6}" for j in range(3)], "replicas": 2,
                        "num_gpus": 1} for i in range(3)],
            "routing": {"policy": "affinity"},
        },
        "tenants": {"items": [{"id": "acme", "key_sha256": ["a" * 64], "adapters": ["a0", "a1"],
                               "requests_per_min": 100}]},
        "redis": {"enabled": False,
                  "external": {"url": "rediss://cache.internal:6380/0", "passwordSecret": "redis-auth"}},
        "state": {"enabled": False,
                  "external": {"url": "rediss://state.internal:6380", "passwordSecret": "state-auth", "cluster": True}},
        "models": {"existingClaim": "loraplex-models"},
        "gateway": {"ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                                "tls": [{"secretName": "llm-tls", "hosts": ["llm.example.com"]}]}},
        "serviceMonitor": {"enabled": True},
        "operator": {"key": "sk-ops"},
        "ray": {"worker": {"replicas": 6, "minReplicas": 6, "maxReplicas": 12},
                "gcsFaultTolerance": {"redisAddress": "ray-gcs.internal:6379", "passwordSecret": "ray-gcs-auth"}},
        "adapterStore": {"url": "s3://llm-adapters/prod", "credentialsSecret": "adapter-store-aws",
                         "endpointUrl": "http://minio.storage:9000", "region": "eu-central-1"},
    }


def lint(values: dict | None) -> dict:
    report = helm.lint(str(CHART), values, strict=True, namespace="serving", kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, (report["errors"], problems)
    return report


@pytest.mark.parametrize("values", [None, multi_shard_values()], ids=["defaults", "multi-shard"])
def test_the_chart_renders_lints_and_its_core_manifests_validate(values) -> None:
    lint(values)
    docs = render(values)
    kinds = [d["kind"] for d in docs]
    assert "RayService" in kinds and "Service" in kinds
    for doc in docs:
        if doc["kind"] in CORE_KINDS:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    service = next(d for d in docs if d["kind"] == "RayService")
    assert service["apiVersion"] == "ray.io/v1"
    workers = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert workers["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(service["spec"]["rayClusterConfig"]["headGroupSpec"])


def test_the_multi_shard_install_has_ingress_monitoring_and_the_tenants_secret() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in render(multi_shard_values())}
    assert ("Ingress", "lp-loraplex") in docs and ("ServiceMonitor", "lp-loraplex") in docs
    assert ("StatefulSet", "lp-loraplex-redis") not in docs and ("StatefulSet", "lp-loraplex-state") not in docs
    assert not [name for kind, name in docs if kind == "NetworkPolicy"]  # external Redis: nothing of ours to guard
    tenants = yaml.safe_load(docs[("Secret", "lp-loraplex-tenants")]["stringData"]["tenants.yaml"])
    assert tenants[0]["id"] == "acme"
    config = serve_config(docs[("RayService", "lp-loraplex")])
    assert config["cache"]["redis_url"] == "rediss://cache.internal:6380/0"
    assert config["state"] == {"redis_url": "rediss://state.internal:6380", "cluster": True, "ephemeral": False,
                               "password_file": "/etc/loraplex/state-redis/password"}
    for pod in ray_pods(docs[("RayService", "lp-loraplex")]):
        volume = next(v for v in pod["volumes"] if v["name"] == "state-redis-password")
        assert volume["secret"]["secretName"] == "state-auth"
        assert {"name": "state-redis-password", "mountPath": "/etc/loraplex/state-redis", "readOnly": True} in (
            pod["containers"][0]["volumeMounts"])
    assert config["tenants_file"] == "/etc/loraplex/tenants/tenants.yaml"
    assert [s["replicas"] for s in config["shards"]] == [2, 2, 2]
    monitor = docs[("ServiceMonitor", "lp-loraplex")]["spec"]["endpoints"][0]
    assert monitor["bearerTokenSecret"] == {"name": "lp-loraplex-operator", "key": "operator-key"}
    assert base64.b64decode(docs[("Secret", "lp-loraplex-operator")]["data"]["operator-key"]) == b"sk-ops"
    assert config["operator_key_file"] == "/etc/loraplex/operator/operator-key"


def test_without_an_operator_key_given_the_chart_makes_one_and_monitoring_uses_it() -> None:
    """Never a deployment nobody can administer, nor one open by default: a random bootstrap operator key."""
    values = multi_shard_values()
    values.pop("operator")
    docs = by_name(render(values))
    key = base64.b64decode(docs[("Secret", "lp-loraplex-operator")]["data"]["operator-key"]).decode()
    assert key.startswith("sk-lpop-") and len(key) == len("sk-lpop-") + 43
    assert key != base64.b64decode(by_name(render(values))[("Secret", "lp-loraplex-operator")]["data"]["operator-key"]).decode()
    monitor = docs[("ServiceMonitor", "lp-loraplex")]["spec"]["endpoints"][0]
    assert monitor["bearerTokenSecret"] == {"name": "lp-loraplex-operator", "key": "operator-key"}
    assert serve_config(docs[("RayService", "lp-loraplex")])["operator_key_file"] == "/etc/loraplex/operator/operator-key"


def test_serve_config_v2_builds_what_loraplex_serve_deploys_for_the_same_config(tmp_path) -> None:
    """deploy/serve.yaml through the chart (tenants into its Secret) gives the same deployment, with the
    state in the chart's state Redis instead of the cache's."""
    local = load_config(ROOT / "deploy" / "serve.yaml")
    source = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    tenants = source.pop("tenants")
    source.pop("state")  # where the state store is: the chart's state: section
    source["http"]["allow_insecure_bind"] = True  # the file's public example keys, now beyond loopback: said so
    docs = by_name(render({"loraplex": source, "tenants": {"items": tenants}}))
    app = yaml.safe_load(docs[("RayService", "lp-loraplex")]["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "gateway.serve:app_from_config" and app["args"]["base_dir"] == "/models"
    config = config_in_pod(list(docs.values()), tmp_path)
    in_cluster = parse_config(config, ROOT / "deploy", "serveConfigV2")  # the files live under /models in the pod

    def comparable(c) -> dict:
        data = c.model_dump()
        for cluster_decides in ("base_dir", "http", "state"):
            data.pop(cluster_decides)
        for redis in ("redis_url", "redis_password_file"):
            data["cache"].pop(redis)
        data["operator_key_sha256"] = data["operator_key_sha256"][:1]  # and the chart's own bootstrap key beside it
        data["registry"].pop("store_dir")  # the chart's adapter-store volume
        return data

    assert comparable(in_cluster) == comparable(local)
    assert in_cluster.cache.redis.url == "redis://lp-loraplex-redis:6379/0" and in_cluster.http.host == "0.0.0.0"
    assert in_cluster.http.listener == "serve-proxy"  # KubeRay's Service and probes expect Serve's proxy on every pod
    assert in_cluster.state_redis().url == "redis://lp-loraplex-state:6379/0" and not in_cluster.state.ephemeral
    from gateway.serve import app_from_config, build

    assert type(app_from_config({"config": config, "base_dir": str(ROOT / "deploy")})) is type(build(local))


def test_the_chart_decides_where_http_listens_and_keeps_the_rest_of_the_users_http_settings() -> None:
    values = multi_shard_values()
    users = {"max_tokens_default": 64, "request_timeout_s": 30}
    values["loraplex"]["http"] = {"port": 1234, "listener": "gateway", **users}
    config = serve_config(next(d for d in render(values) if d["kind"] == "RayService"))
    # and its one gateway replica on the head (tests/deploy/test_helm_ray.py)
    assert config["http"] == {"host": "0.0.0.0", "port": 8000, "listener": "serve-proxy", **users,
                              "node_labels": {"loraplex.io/ingress": "yes"}}


def test_the_chart_passes_the_engine_device_and_routing_sections_on(tmp_path) -> None:
    settings = {"engine": {"num_seq_slots": 4}, "device": {"dtype": "bfloat16"}, "routing": {"policy": "random", "eps": 0.5}}
    lint({"loraplex": settings})
    parsed = parse_config(config_in_pod(render({"loraplex": settings, **KEYED}), tmp_path), ".", "serveConfigV2")
    assert (parsed.engine.num_seq_slots, parsed.device.dtype, parsed.routing.policy) == (4, "bfloat16", "random")


@pytest.mark.parametrize(("change", "fragment"), [
    ({"gateway": {"service": {"type": "Bogus"}}}, "type"),
    ({"ray": {"worker": {"gpusPerPod": -1}}}, "gpusPerPod"),
    ({"redis": {"maxmemoryPolicy": "everything"}}, "maxmemoryPolicy"),
    ({"loraplex": {"shards": []}}, "shards"),
    ({"tenants": {"items": [{"id": "t", "key_sha256": ["plaintext-key"]}]}}, "key_sha256"),
    ({"colour": "blue"}, "colour"),
    ({"redis": {"enabled": False}}, "url"),
    ({"loraplex": {"shards": [{"name": "s"}], "tenants": [{"id": "t"}]}}, "tenants"),
    ({"loraplex": {"shards": [{"name": "s"}], "routing": "fastest"}}, "routing"),
    ({"loraplex": {"shards": [{"name": "s"}], "routing": {"policy": "fastest"}}}, "routing"),
    ({"adapterStore": {"url": "https://bucket.example.com/x"}}, "url"),
    ({"adapterStore": {"endpointUrl": "minio:9000"}}, "endpointUrl"),
    ({"state": {"maxmemoryPolicy": "allkeys-lru"}}, "maxmemoryPolicy"),  # the state store never evicts
    ({"state": {"external": {"url": "state.internal:6379"}}}, "url"),
    ({"state": {"persistence": {"size": ""}}}, "size"),
    ({"loraplex": {"shards": [{"name": "s"}], "state": {"redis_url": "redis://x:6379/0"}}}, "redis_url"),
])
def test_the_schema_rejects_bad_values_with_the_key(change, fragment) -> None:
    chart = helm.Chart.load(str(CHART))
    values = chart.merge_values(change)
    if "loraplex" in change:  # a replaced list, not a merged one
        values["loraplex"] = {**values["loraplex"], **change["loraplex"]}
    with pytest.raises(helm.HelmError) as e:
        chart.validate_schema(values)
    assert fragment in str(e.value)


@pytest.mark.parametrize("claim", ["", "loraplex-adapters"])
def test_every_ray_pod_mounts_the_adapter_store_the_config_names(claim) -> None:
    docs = render({"adapterStore": {"mountPath": "/adapters", "existingClaim": claim}})
    service = next(d for d in docs if d["kind"] == "RayService")
    assert serve_config(service)["registry"]["store_dir"] == "/adapters"
    for pod in ray_pods(service):
        volume = next(v for v in pod["volumes"] if v["name"] == "adapter-store")
        assert (volume.get("persistentVolumeClaim", {}).get("claimName") == claim) if claim else "emptyDir" in volume
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "adapter-store")
        assert mount["mountPath"] == "/adapters" and not mount.get("readOnly")


def test_every_ray_container_gets_the_serve_settings_loraplex_serve_uses() -> None:
    from gateway.serve import SERVE_ENV

    for pod in ray_pods(next(d for d in render() if d["kind"] == "RayService")):
        assert {e["name"]: e["value"] for e in pod["containers"][0]["env"]} == SERVE_ENV


def test_the_adapter_store_url_and_credentials_reach_the_config_and_every_ray_container() -> None:
    service = next(d for d in render(multi_shard_values()) if d["kind"] == "RayService")
    config = serve_config(service)
    assert config["registry"] == {"store_url": "s3://llm-adapters/prod", "store_dir": "/adapters"}  # the volume: each pod's cache
    assert RegistrySettings.model_validate(config["registry"]).store_url == "s3://llm-adapters/prod"
    for pod in ray_pods(service):  # the gateway and the workers may run on any Ray pod
        container = pod["containers"][0]
        assert container["envFrom"] == [{"secretRef": {"name": "adapter-store-aws"}}]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["AWS_ENDPOINT_URL"] == "http://minio.storage:9000" and env["AWS_DEFAULT_REGION"] == "eu-central-1"
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": ray_pods(service)[1]},
                                 KUBE_VERSION, strict=True)


@pytest.mark.parametrize("workers", [{"replicas": 2, "minReplicas": 2, "maxReplicas": 2}, {"maxReplicas": 3}],
                         ids=["replicas", "autoscaling"])
def test_the_emptydir_adapter_store_is_refused_when_more_than_one_worker_pod_may_run(workers) -> None:
    values = {"ray": {"worker": workers}}
    with pytest.raises(helm.HelmError, match="workers on other pods cannot read the gateway's disk") as e:
        render(values)
    assert "adapterStore.url" in str(e.value) and "ReadWriteMany" in str(e.value)
    for fix in ({"url": "s3://adapters"}, {"existingClaim": "adapters-rwx"}):  # either is fine
        lint({**values, "adapterStore": fix})
        render({**values, "adapterStore": fix})


def test_tracing_settings_reach_the_config_the_application_is_built_from(tmp_path) -> None:
    tracing = {"otlp_endpoint": "http://otel-collector.monitoring:4318", "service_name": "llm", "sample_ratio": 0.1}
    lint({"loraplex": {"tracing": tracing}})
    config = config_in_pod(render({"loraplex": {"tracing": tracing}, **KEYED}), tmp_path)
    assert parse_config(config, ".", "serveConfigV2").tracing == TracingSettings(**tracing)
    with pytest.raises(helm.HelmError, match="otlp_endpoint"):
        render({"loraplex": {"tracing": {"otlp_endpoint": "otel-collector:4318"}}})
