"""The Helm chart's manifests as the pods Kubernetes and KubeRay would run, for `podman kube play`.

A cluster turns the chart into pods: the StatefulSets' controller makes `NAME-0` with its claim,
KubeRay's operator makes the Ray head and worker pods from the RayService (its `ray start`
command, environment, `/dev/shm`, probes, GCS fault tolerance) and submits `serveConfigV2` to the
head, kubelet resolves `secretKeyRef`, `fieldRef` and `$(VAR)`, and cluster DNS gives every
Service a name. podman 4.3's `kube play` runs Pods and PersistentVolumeClaims and none of the
rest, so this module does those parts, as KubeRay 1.x does them for Ray 2.53 and newer:

- a Secret becomes files (mounted with hostPath) and values (env), never a manifest;
- a StatefulSet becomes its one Pod `NAME-0`, its claim template a PersistentVolumeClaim;
- the RayService becomes a head Pod and the worker group's Pods, its `serveConfigV2` the text a
  controller would submit (deploy/local-kube.sh runs `serve deploy` with it);
- each Pod gets a static address, and every Service's names (short and fully qualified) point at
  the first Pod it selects through `hostAliases`, as cluster DNS would;
- a Service port may be published on the host (`publish`), standing in for a NodePort.

What cannot run here is dropped and listed (`Translation.dropped`): Services, NetworkPolicy,
ServiceMonitor, Ingress, nodeSelector and tolerations (one node), image pull secrets, probes
(podman runs no readiness probes; the probe commands are kept in `Translation.probes` for the
caller to run). A field this module does not know fails loudly (`Untranslatable`) rather than
vanish. No library does this outside a cluster (KubeRay's own code is Go, inside the operator),
hence our own, kept to what the chart uses.
"""

from __future__ import annotations

import base64
import copy
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DROPPED_KINDS = {"Service", "NetworkPolicy", "ServiceMonitor", "Ingress"}
POD_KEYS = {"containers", "initContainers", "volumes", "hostname", "restartPolicy", "securityContext",
            "terminationGracePeriodSeconds"}
POD_DROPPED = {"nodeSelector", "tolerations", "imagePullSecrets", "affinity"}
CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports", "resources",
                  "volumeMounts", "workingDir", "securityContext"}
CONTAINER_DROPPED = {"readinessProbe", "livenessProbe", "startupProbe"}
GCS_RECONNECT_S = "600"  # KubeRay's worker default with GCS fault tolerance
DASHBOARD_AGENT_PORT = 52365
RAY_PORT = 6379


class Untranslatable(ValueError):
    """A manifest field that podman cannot run and this translation does not stand in for."""


@dataclass
class Translation:
    pods: list[dict]                          # in start order: Redis and other StatefulSets, the Ray head, its workers
    claims: list[dict] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)   # a Secret's file: its path -> content
    dirs: dict[str, str | None] = field(default_factory=dict)  # an emptyDir's folder -> its tmpfs size, if in memory
    addresses: dict[str, str] = field(default_factory=dict)  # pod -> its static address
    probes: dict[str, str] = field(default_factory=dict)     # pod -> a readiness command to exec in its first container
    serve_config: str = ""
    dropped: list[str] = field(default_factory=list)

    def pod_yaml(self, name: str) -> str:
        """One pod (with the claims it mounts) as `podman kube play` takes it."""
        pod = next(p for p in self.pods if p["metadata"]["name"] == name)
        used = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"].get("volumes", [])
                if "persistentVolumeClaim" in v}
        claims = [c for c in self.claims if c["metadata"]["name"] in used]
        return yaml.safe_dump_all([*claims, pod], sort_keys=False)


class _Secrets:
    def __init__(self, docs: list[dict]) -> None:
        self.by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}

    def _secret(self, name: str) -> dict:
        if name not in self.by_name:
            raise Untranslatable(f"Secret {name} is named but not among the manifests (create it with them)")
        return self.by_name[name]

    def value(self, name: str, key: str) -> str:
        secret = self._secret(name)
        if key in secret.get("stringData", {}):
            return str(secret["stringData"][key])
        if key not in secret.get("data", {}):
            raise Untranslatable(f"Secret {name} has no key {key}")
        return base64.b64decode(secret["data"][key]).decode()

    def keys(self, name: str) -> list[str]:
        secret = self._secret(name)
        return [*secret.get("stringData", {}), *secret.get("data", {})]


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` in command, args and env values: a defined VAR is replaced, `$$` escapes."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def _field_ref(path: str, meta: dict, namespace: str) -> str:
    if path == "metadata.name":
        return meta["name"]
    if path == "metadata.namespace":
        return namespace
    label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if label and label.group(1) in meta.get("labels", {}):
        return meta["labels"][label.group(1)]
    raise Untranslatable(f"fieldRef {path} of pod {meta['name']}")


def _resolve_env(container: dict, meta: dict, namespace: str, secrets: _Secrets) -> None:
    """env and envFrom as plain values, `$(VAR)` expanded in env, command and args, in the kubelet's order."""
    resolved: dict[str, str] = {}
    for source in container.pop("envFrom", []):
        if set(source) != {"secretRef"}:
            raise Untranslatable(f"envFrom {source} in {meta['name']}")
        name = source["secretRef"]["name"]
        resolved.update({key: secrets.value(name, key) for key in secrets.keys(name)})
    for item in container.get("env", []):
        if "value" in item:
            resolved[item["name"]] = _expand(str(item["value"]), resolved)
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            resolved[item["name"]] = secrets.value(ref["name"], ref["key"])
        elif "fieldRef" in item.get("valueFrom", {}):
            resolved[item["name"]] = _field_ref(item["valueFrom"]["fieldRef"]["fieldPath"], meta, namespace)
        else:
            raise Untranslatable(f"env {item['name']} of {meta['name']}: {item.get('valueFrom')}")
    container["env"] = [{"name": k, "value": v} for k, v in resolved.items()]
    for key in ("command", "args"):
        if key in container:
            container[key] = [_expand(str(part), resolved) for part in container[key]]


def _check_keys(kind: str, name: str, got: dict, allowed: set[str], dropped: set[str], notes: list[str]) -> None:
    unknown = set(got) - allowed - dropped
    if unknown:
        raise Untranslatable(f"{kind} {name}: {sorted(unknown)} cannot be run by podman kube play here")
    for key in sorted(set(got) & dropped):
        notes.append(f"{kind} {name}: {key} dropped")
        got.pop(key)


def _volumes(pod: dict, secrets: _Secrets, root: Path, out: Translation) -> None:
    """Secrets as files, emptyDirs as folders the caller makes (mode 0777, as kubelet's; a tmpfs
    of the size asked for `medium: Memory`): podman's own emptyDir ignores `medium`, silently."""
    name = pod["metadata"]["name"]
    for volume in pod["spec"].get("volumes", []):
        folder = root / name / volume["name"]
        if "secret" in volume:
            source = volume.pop("secret")
            items = source.get("items") or [{"key": k, "path": k} for k in secrets.keys(source["secretName"])]
            for item in items:
                out.files[str(folder / item["path"])] = secrets.value(source["secretName"], item["key"])
            volume["hostPath"] = {"path": str(folder), "type": "Directory"}
        elif "emptyDir" in volume:
            empty = volume.pop("emptyDir")
            memory = empty.get("medium") == "Memory"
            if memory and not empty.get("sizeLimit"):
                raise Untranslatable(f"pod {name}: emptyDir {volume['name']} in memory with no sizeLimit")
            out.dirs[str(folder)] = _bytes(empty["sizeLimit"]) if memory else None
            volume["hostPath"] = {"path": str(folder), "type": "Directory"}
        elif "persistentVolumeClaim" not in volume:
            raise Untranslatable(f"pod {name}: volume {volume}")


def _bytes(quantity: str) -> str:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity))
    if not match or (match.group(2) and match.group(2) not in units):
        raise Untranslatable(f"memory quantity {quantity}")
    return str(int(match.group(1)) * units.get(match.group(2), 1))


def _cpus(quantity: Any) -> int:
    text = str(quantity)
    return int(text[:-1]) // 1000 if text.endswith("m") else int(float(text))


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
class _RayCluster:
    name: str
    namespace: str
    head_fqdn: str
    ft: dict | None
    secrets: _Secrets

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
            params.setdefault("num-cpus", str(_cpus(cpu)))
        if "memory" in limits:
            params.setdefault("memory", _bytes(limits["memory"]))
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


def _selects(selector: dict, pod: dict) -> bool:
    labels = pod["metadata"].get("labels", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _port(container: dict, target: Any) -> dict:
    for port in container.get("ports", []):
        if target in (port.get("name"), port.get("containerPort")):
            return port
    raise Untranslatable(f"container {container['name']} has no port {target}")


def translate(docs: list[dict], *, subnet: str, root: Path, namespace: str = "default", worker_pods: int | None = None,
              publish: dict[str, int] | None = None) -> Translation:
    """`docs`: the rendered chart (and anything an operator installs beside it: a Secret, an S3
    store's Pod and Service). `subnet`: the podman network's, from whose hosts each pod gets an
    address. `root`: the folder under which Secrets' files and emptyDirs go. `worker_pods`: the
    worker group's pods (default: its `replicas`). `publish`: a Service's name -> the host port
    its first port is published on."""
    secrets, out = _Secrets(docs), Translation(pods=[])
    services = [d for d in docs if d["kind"] == "Service"]
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        if kind in DROPPED_KINDS:
            out.dropped.append(f"{kind} {name}" + (": its names resolve to the pod it selects" if kind == "Service" else ""))
        elif kind == "ConfigMap":
            out.dropped.append(f"ConfigMap {name}: no pod mounts it")
        elif kind == "PersistentVolumeClaim":
            out.claims.append(doc)
        elif kind == "StatefulSet":
            out.pods.append(_statefulset_pod(doc, out))
        elif kind == "Pod":
            out.pods.append(copy.deepcopy(doc))
        elif kind == "RayService":
            out.pods.extend(_ray_pods(doc, namespace, worker_pods, secrets, out))
        elif kind != "Secret":
            raise Untranslatable(f"{kind} {name}: no stand-in for this kind")
    def order(pod: dict) -> tuple[bool, bool]:  # what the Ray pods need first, then the head, then its workers
        node = pod["metadata"].get("labels", {}).get("ray.io/node-type")
        return node is not None, node == "worker"

    out.pods.sort(key=order)
    hosts = ipaddress.ip_network(subnet).hosts()
    next(hosts)  # the gateway of the network
    for pod in out.pods:
        out.addresses[pod["metadata"]["name"]] = str(next(hosts))
    _finish_pods(out, secrets, services, namespace, publish or {}, root)
    return out


def _statefulset_pod(doc: dict, out: Translation) -> dict:
    name, spec = doc["metadata"]["name"], doc["spec"]
    if spec.get("replicas", 1) != 1:
        raise Untranslatable(f"StatefulSet {name}: {spec['replicas']} replicas (one pod each is not done here)")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": copy.deepcopy(spec["template"].get("metadata", {})),
           "spec": copy.deepcopy(spec["template"]["spec"])}
    pod["metadata"]["name"] = f"{name}-0"
    for template in spec.get("volumeClaimTemplates", []):
        claim = f"{template['metadata']['name']}-{name}-0"
        out.claims.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                           "metadata": {"name": claim}, "spec": copy.deepcopy(template["spec"])})
        pod["spec"].setdefault("volumes", []).append(
            {"name": template["metadata"]["name"], "persistentVolumeClaim": {"claimName": claim}})
    return pod


def _ray_pods(doc: dict, namespace: str, worker_pods: int | None, secrets: _Secrets, out: Translation) -> list[dict]:
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
    cluster = _RayCluster(name, namespace, f"{name}-head-svc.{namespace}.svc.cluster.local",
                          config.get("gcsFaultToleranceOptions"), secrets)
    head = config["headGroupSpec"]
    pods = [cluster.pod(head["template"], f"{name}-head", "headgroup", head.get("rayStartParams", {}), head=True)]
    for group in config.get("workerGroupSpecs", []):
        count = group.get("replicas", 1) if worker_pods is None else worker_pods
        pods += [cluster.pod(group["template"], f"{name}-{group['groupName']}-worker-{i}", group["groupName"],
                             group.get("rayStartParams", {}), head=False) for i in range(count)]
    for pod in pods:
        serve = _port(pod["spec"]["containers"][0], "serve")["containerPort"]
        out.probes[pod["metadata"]["name"]] = _probe(pod["metadata"]["labels"]["ray.io/node-type"] == "head", serve)
    return pods


def _finish_pods(out: Translation, secrets: _Secrets, services: list[dict], namespace: str, publish: dict[str, int],
                 root: Path) -> None:
    aliases: dict[str, list[str]] = {}
    for service in services:
        pod = next((p for p in out.pods if _selects(service["spec"].get("selector", {}), p)), None)
        if pod is not None:
            aliases.setdefault(out.addresses[pod["metadata"]["name"]], []).extend(_dns(service["metadata"]["name"], namespace))
        if service["metadata"]["name"] in publish:
            if pod is None:
                raise Untranslatable(f"Service {service['metadata']['name']} selects no pod to publish")
            port = service["spec"]["ports"][0]
            _port(pod["spec"]["containers"][0], port["targetPort"])["hostPort"] = publish[service["metadata"]["name"]]
    for pod in out.pods:  # KubeRay's head Service, named for the RayService
        if pod["metadata"]["labels"].get("ray.io/node-type") == "head":
            aliases.setdefault(out.addresses[pod["metadata"]["name"]], []).extend(
                _dns(f"{pod['metadata']['labels']['ray.io/cluster']}-head-svc", namespace))
    host_aliases = [{"ip": ip, "hostnames": names} for ip, names in aliases.items()]
    for pod in out.pods:
        meta, spec = pod["metadata"], pod["spec"]
        _check_keys("pod", meta["name"], spec, POD_KEYS, POD_DROPPED, out.dropped)
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            label = f"{meta['name']}/{container['name']}"
            _check_keys("container", label, container, CONTAINER_KEYS, CONTAINER_DROPPED, out.dropped)
            _resolve_env(container, meta, namespace, secrets)
            # kube play 4.3 publishes every containerPort on the host; a pod's address reaches its ports anyway
            container["ports"] = [p for p in container.get("ports", []) if "hostPort" in p]
        _volumes(pod, secrets, root, out)
        spec["hostAliases"] = host_aliases
        spec["hostname"] = meta["name"]


def _dns(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]
