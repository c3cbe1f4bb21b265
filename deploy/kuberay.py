"""The Ray pods KubeRay's operator makes from a RayService, as its KubeRay 1.x code does for Ray 2.53
and newer (ray-operator/controllers/ray/common/pod.go: BuildPod): the `ray start` command written
from the container's resources and `rayStartParams`, the environment for a RayService, `/dev/shm`,
GCS fault tolerance's variables and the readiness probes' commands. Part of deploy/kube_pods.py's
translation; our own for the reason given there."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from deploy.kube_base import Secrets, Translation, Untranslatable, container_port, quantity_bytes, quantity_cpus

GCS_RECONNECT_S = "600"  # KubeRay's worker default with GCS fault tolerance
DASHBOARD_AGENT_PORT = 52365
RAY_PORT = 6379


def _ray_start(params: dict[str, Any]) -> str:
    """KubeRay's flags: sorted, `true` a bare switch, `false` left out."""
    flags = []
    for key in sorted(params):
        value = str(params[key])
        if value.lower() == "true":
            flags.append(f"--{key}")
        elif value.lower() != "false":
            flags.append(f"--{key}={value}")
    return " ".join(flags)


@dataclass
class RayCluster:
    name: str
    namespace: str
    head_fqdn: str
    ft: dict | None
    secrets: Secrets

    def pod(self, template: dict, pod_name: str, group: str, params: dict, head: bool) -> dict:
        """A Ray pod as KubeRay builds it (ray-operator/controllers/ray/common/pod.go: BuildPod)."""
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": copy.deepcopy(template.get("metadata", {})),
               "spec": copy.deepcopy(template["spec"])}
        pod["metadata"]["name"] = pod_name
        pod["metadata"].setdefault("labels", {}).update(
            {"ray.io/cluster": self.name, "ray.io/node-type": "head" if head else "worker",
             "ray.io/group": "headgroup" if head else group, "ray.io/is-ray-node": "yes"})
        container = pod["spec"]["containers"][0]
        params = {str(k): str(v) for k, v in params.items()}
        resources = container.get("resources", {})
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        if "nvidia.com/gpu" in limits:
            raise Untranslatable(f"{pod_name}: nvidia.com/gpu (no GPU here: set ray.worker.gpusPerPod to 0)")
        cpu = limits.get("cpu", requests.get("cpu"))
        if cpu is not None:
            params.setdefault("num-cpus", str(quantity_cpus(cpu)))
        if "memory" in limits:
            params.setdefault("memory", quantity_bytes(limits["memory"]))
        if head:
            params.setdefault("dashboard-host", "0.0.0.0")
        else:
            params.setdefault("address", f"{self.head_fqdn}:{RAY_PORT}")
        params.setdefault("metrics-export-port", "8080")
        params.setdefault("dashboard-agent-listen-port", str(DASHBOARD_AGENT_PORT))
        params["block"] = "true"
        env = container.setdefault("env", [])
        if self.ft is not None:
            self._fault_tolerance(env, params, head)
        start = f"ray start {'--head ' if head else ''}{_ray_start(params)}"
        container["command"] = ["/bin/bash", "-c", "--"]
        container["args"] = [f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; {start}"]
        ip = "127.0.0.1" if head else self.head_fqdn
        kuberay = {"RAY_CLUSTER_NAME": self.name, "RAY_CLUSTER_NAMESPACE": self.namespace,
                   "RAY_CLOUD_INSTANCE_ID": pod_name, "RAY_NODE_TYPE_NAME": "headgroup" if head else group,
                   "KUBERAY_GEN_RAY_START_CMD": start, "RAY_PORT": str(RAY_PORT),
                   "RAY_timeout_ms_task_wait_for_death_info": "0", "RAY_gcs_server_request_timeout_seconds": "5",
                   "RAY_SERVE_KV_TIMEOUT_S": "5", "RAY_ADDRESS": f"{ip}:{RAY_PORT}",
                   "RAY_USAGE_STATS_KUBERAY_IN_USE": "1", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1"}
        if not head:
            kuberay |= {"FQ_RAY_IP": self.head_fqdn, "RAY_IP": self.head_fqdn.split(".")[0]}
        present = {e["name"] for e in env}
        env.extend({"name": k, "value": v} for k, v in kuberay.items() if k not in present)
        container.setdefault("volumeMounts", []).append({"name": "shared-mem", "mountPath": "/dev/shm"})
        memory = limits.get("memory", requests.get("memory"))
        pod["spec"].setdefault("volumes", []).append(
            {"name": "shared-mem", "emptyDir": {"medium": "Memory", **({"sizeLimit": memory} if memory else {})}})
        return pod

    def _fault_tolerance(self, env: list[dict], params: dict, head: bool) -> None:
        """GCS fault tolerance on an external Redis (gcsFaultToleranceOptions): the head's GCS keeps
        its tables there; workers wait up to 600 s for a new head instead of Ray's 60."""
        if not head:
            env.append({"name": "RAY_gcs_rpc_server_reconnect_timeout_s", "value": GCS_RECONNECT_S})
            return
        unknown = set(self.ft) - {"redisAddress", "redisPassword", "externalStorageNamespace"}
        if unknown:
            raise Untranslatable(f"gcsFaultToleranceOptions: {sorted(unknown)}")
        env.append({"name": "RAY_external_storage_namespace", "value": self.ft.get("externalStorageNamespace", self.name)})
        env.append({"name": "RAY_REDIS_ADDRESS", "value": self.ft["redisAddress"]})
        password = self.ft.get("redisPassword")
        if password is not None:
            env.append({"name": "REDIS_PASSWORD", **password})
            params["redis-password"] = "$REDIS_PASSWORD"


def _probe(head: bool, serve_port: int) -> str:
    """KubeRay's readiness probe for Ray 2.53+ (the node's health endpoint), plus the Serve proxy's
    health on RayService workers, as one command."""
    checks = [f"wget --tries 1 -T 2 -q -O- http://localhost:{DASHBOARD_AGENT_PORT}/api/healthz"]
    if not head:
        checks.append(f"wget --tries 1 -T 2 -q -O- http://localhost:{serve_port}/-/healthz")
    return " && ".join(f"{c} >/dev/null" for c in checks)


def ray_pods(doc: dict, namespace: str, worker_pods: int | None, secrets: Secrets, out: Translation) -> list[dict]:
    name, spec = doc["metadata"]["name"], doc["spec"]
    unknown = set(spec) - {"serveConfigV2", "rayClusterConfig"}
    if unknown:
        raise Untranslatable(f"RayService {name}: {sorted(unknown)}")
    out.serve_config = spec["serveConfigV2"]
    config = spec["rayClusterConfig"]
    unknown = set(config) - {"rayVersion", "enableInTreeAutoscaling", "headGroupSpec", "workerGroupSpecs",
                             "gcsFaultToleranceOptions"}
    if unknown:
        raise Untranslatable(f"RayService {name} rayClusterConfig: {sorted(unknown)}")
    if config.get("enableInTreeAutoscaling"):
        out.dropped.append(f"RayService {name}: enableInTreeAutoscaling (no autoscaler: the worker pods are fixed)")
    cluster = RayCluster(name, namespace, f"{name}-head-svc.{namespace}.svc.cluster.local",
                          config.get("gcsFaultToleranceOptions"), secrets)
    head = config["headGroupSpec"]
    pods = [cluster.pod(head["template"], f"{name}-head", "headgroup", head.get("rayStartParams", {}), head=True)]
    for group in config.get("workerGroupSpecs", []):
        count = group.get("replicas", 1) if worker_pods is None else worker_pods
        pods += [cluster.pod(group["template"], f"{name}-{group['groupName']}-worker-{i}", group["groupName"],
                             group.get("rayStartParams", {}), head=False) for i in range(count)]
    for pod in pods:
        serve = container_port(pod["spec"]["containers"][0], "serve")["containerPort"]
        out.probes[pod["metadata"]["name"]] = _probe(pod["metadata"]["labels"]["ray.io/node-type"] == "head", serve)
    return pods
