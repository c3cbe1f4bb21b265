"""deploy/kube_pods.py: the chart's manifests as the pods a cluster with KubeRay would run, for podman.
Pure translation of the real rendered chart (deploy/podman/values.yaml, this machine's); the pods
themselves run in tests/deploy/test_local_kube.py."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import pytest
import yaml

from deploy.kube_pods import Untranslatable, translate
from deploy.local_kube import VALUES, operator_manifests
from tests.deploy.test_helm import render

HEAD, WORKER = "lp-loraplex-head", "lp-loraplex-cpu-worker-0"


def local_docs(**changes) -> list[dict]:
    values = yaml.safe_load(VALUES.read_text())
    values["operator"] = {"key": "sk-ops"}
    values["tenants"] = {"items": [{"id": "t", "key_sha256": ["a" * 64], "adapters": "*"}]}
    for key, value in changes.items():
        values[key] = value
    return [*render(values), *operator_manifests()]


def pods_of(tmp_path: Path, docs: list[dict] | None = None, **kw):
    return translate(local_docs() if docs is None else docs, subnet="10.89.41.0/24", namespace="serving", root=tmp_path,
                     publish={"lp-loraplex-gateway": 18000}, **kw)


def by_name(translation) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in translation.pods}


def env_of(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def test_the_pods_kuberay_and_the_statefulsets_would_make_in_start_order(tmp_path) -> None:
    t = pods_of(tmp_path)
    assert [p["metadata"]["name"] for p in t.pods] == [
        "lp-loraplex-redis-0", "lp-loraplex-state-0", "s3", HEAD, WORKER, "lp-loraplex-cpu-worker-1"]
    assert len(set(t.addresses.values())) == 6 and all(a.startswith("10.89.41.") and a != "10.89.41.1" for a in t.addresses.values())
    assert [c["metadata"]["name"] for c in t.claims] == ["data-lp-loraplex-state-0"]
    assert "persistentVolumeClaim" in str(by_name(t)["lp-loraplex-state-0"]["spec"]["volumes"])
    assert "applications" in yaml.safe_load(t.serve_config)
    assert len(by_name(pods_of(tmp_path, worker_pods=3))) == 7


def test_ray_start_as_kuberay_writes_it_from_resources_and_rayStartParams(tmp_path) -> None:
    pods = by_name(pods_of(tmp_path))
    head, worker = pods[HEAD]["spec"]["containers"][0], pods[WORKER]["spec"]["containers"][0]
    assert head["command"] == ["/bin/bash", "-c", "--"]
    head_flags = shlex.split(head["args"][0].split("; ", 1)[1])
    assert head_flags[:3] == ["ray", "start", "--head"]
    assert {"--block", "--num-cpus=0", "--memory=3221225472", "--dashboard-host=0.0.0.0", "--labels=loraplex.io/ingress=yes",
            "--metrics-export-port=8080", "--dashboard-agent-listen-port=52365", "--redis-password=$REDIS_PASSWORD"} <= set(head_flags)
    worker_flags = shlex.split(worker["args"][0].split("; ", 1)[1])
    assert {"--address=lp-loraplex-head-svc.serving.svc.cluster.local:6379", "--num-cpus=1", "--block"} <= set(worker_flags)
    assert worker["args"][0].startswith("ulimit -n ${RAY_START_ULIMIT_OPEN_FILES:-65536}; ray start ")
    assert env_of(pods[WORKER])["KUBERAY_GEN_RAY_START_CMD"] == " ".join(worker_flags)


def test_kuberays_environment_and_gcs_fault_tolerance(tmp_path) -> None:
    t = pods_of(tmp_path)
    head, worker = env_of(by_name(t)[HEAD]), env_of(by_name(t)[WORKER])
    password = Path(next(p for p in t.files if p.endswith(f"{HEAD}/state-redis-password/password"))).name
    assert head["RAY_REDIS_ADDRESS"] == "lp-loraplex-state:6379" and head["RAY_external_storage_namespace"] == "lp-loraplex"
    assert head["REDIS_PASSWORD"] == t.files[str(tmp_path / HEAD / "state-redis-password" / password)]
    assert "RAY_REDIS_ADDRESS" not in worker and worker["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
    for env, node in ((head, "127.0.0.1"), (worker, "lp-loraplex-head-svc.serving.svc.cluster.local")):
        assert env["RAY_ADDRESS"] == f"{node}:6379" and env["RAY_SERVE_KV_TIMEOUT_S"] == "5"
        assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"  # the chart's own env kept
    assert worker["RAY_CLUSTER_NAME"] == "lp-loraplex" and worker["RAY_CLOUD_INSTANCE_ID"] == WORKER
    assert worker["AWS_ENDPOINT_URL"] == "http://s3:5000" and worker["AWS_ACCESS_KEY_ID"] == "local-kube"  # envFrom the Secret


def test_secrets_become_files_and_values_and_kubelets_variables_are_expanded(tmp_path) -> None:
    t = pods_of(tmp_path)
    state = by_name(t)["lp-loraplex-state-0"]["spec"]["containers"][0]
    password = env_of(by_name(t)["lp-loraplex-state-0"])["REDIS_PASSWORD"]
    assert len(password) == 32 and state["args"][state["args"].index("--requirepass") + 1] == password
    assert env_of(by_name(t)["lp-loraplex-state-0"])["REDISCLI_AUTH"] == password  # $(REDIS_PASSWORD) in env
    assert t.files[str(tmp_path / WORKER / "operator-key" / "operator-key")] == "sk-ops"
    assert yaml.safe_load(t.files[str(tmp_path / HEAD / "tenants" / "tenants.yaml")])[0]["id"] == "t"
    volumes = {v["name"]: v for v in by_name(t)[WORKER]["spec"]["volumes"]}
    assert volumes["operator-key"] == {"name": "operator-key", "hostPath": {"path": str(tmp_path / WORKER / "operator-key"),
                                                                            "type": "Directory"}}
    assert not [d for d in yaml.safe_load_all(t.pod_yaml(WORKER)) if d["kind"] == "Secret"]


def test_empty_dirs_are_folders_and_dev_shm_a_tmpfs_of_the_containers_memory(tmp_path) -> None:
    t = pods_of(tmp_path)
    assert t.dirs[str(tmp_path / WORKER / "shared-mem")] == str(3 * 2**30)
    assert t.dirs[str(tmp_path / WORKER / "adapter-store")] is None  # the chart's emptyDir store: each pod its own
    mounts = {m["mountPath"]: m["name"] for m in by_name(t)[WORKER]["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["/dev/shm"] == "shared-mem" and mounts["/models"] == "models"
    models = next(v for v in by_name(t)[WORKER]["spec"]["volumes"] if v["name"] == "models")
    assert models["persistentVolumeClaim"]["claimName"] == "loraplex-models"


def test_services_become_names_and_only_the_published_port_is_a_host_port(tmp_path) -> None:
    t = pods_of(tmp_path)
    aliases = {name: a["ip"] for a in by_name(t)[WORKER]["spec"]["hostAliases"] for name in a["hostnames"]}
    assert aliases["lp-loraplex-state"] == aliases["lp-loraplex-state.serving.svc.cluster.local"] == t.addresses["lp-loraplex-state-0"]
    assert aliases["lp-loraplex-head-svc.serving.svc.cluster.local"] == t.addresses[HEAD]
    assert aliases["s3"] == t.addresses["s3"] and aliases["lp-loraplex-gateway"] == t.addresses[HEAD]
    ports = {p["metadata"]["name"]: p["spec"]["containers"][0]["ports"] for p in t.pods}
    assert ports[HEAD] == [{"containerPort": 8000, "name": "serve", "hostPort": 18000}]
    assert all(not ports[name] for name in ports if name != HEAD)
    assert {"Service lp-loraplex-gateway", "NetworkPolicy lp-loraplex-state", "ConfigMap lp-loraplex-dashboard"} <= {
        line.split(":")[0] for line in t.dropped}
    assert t.probes[WORKER].endswith("http://localhost:8000/-/healthz >/dev/null") and "52365/api/healthz" in t.probes[HEAD]


@pytest.mark.parametrize(("break_it", "message"), [
    (lambda docs: docs.append({"kind": "CronJob", "metadata": {"name": "x"}}), "CronJob x"),
    (lambda docs: pod(docs, "s3")["spec"].update(hostNetwork=True), "hostNetwork"),
    (lambda docs: pod(docs, "s3")["spec"]["containers"][0].update(lifecycle={}), "lifecycle"),
    (lambda docs: pod(docs, "s3")["spec"].update(volumes=[{"name": "v", "configMap": {"name": "c"}}]), "configMap"),
    (lambda docs: pod(docs, "s3")["spec"].update(volumes=[{"name": "v", "emptyDir": {"medium": "Memory"}}]), "no sizeLimit"),
    (lambda docs: docs.remove(next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "loraplex-s3")),
     "Secret loraplex-s3"),
    (lambda docs: next(d for d in docs if d["kind"] == "StatefulSet")["spec"].update(replicas=3), "3 replicas"),
    (lambda docs: rayservice(docs)["rayClusterConfig"].update(autoscalerOptions={}), "autoscalerOptions"),
    (lambda docs: rayservice(docs)["rayClusterConfig"]["gcsFaultToleranceOptions"].update(redisUsername={}), "redisUsername"),
])
def test_what_it_cannot_express_fails_loudly(tmp_path, break_it, message) -> None:
    docs = copy.deepcopy(local_docs())
    break_it(docs)
    with pytest.raises(Untranslatable, match=message):
        pods_of(tmp_path, docs)


def test_a_gpu_worker_is_refused_here(tmp_path) -> None:
    docs = local_docs(ray={"worker": {"replicas": 2, "minReplicas": 2, "maxReplicas": 2, "gpusPerPod": 1}})
    with pytest.raises(Untranslatable, match="nvidia.com/gpu"):
        pods_of(tmp_path, docs)


def pod(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "Pod" and d["metadata"]["name"] == name)


def rayservice(docs: list[dict]) -> dict:
    return next(d for d in docs if d["kind"] == "RayService")["spec"]
