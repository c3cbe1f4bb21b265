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

import copy
import ipaddress
import re
from pathlib import Path

from deploy.kube_base import Secrets, Translation, Untranslatable, container_port, quantity_bytes
from deploy.kuberay import ray_pods

DROPPED_KINDS = {"Service", "NetworkPolicy", "ServiceMonitor", "Ingress"}
POD_KEYS = {"containers", "initContainers", "volumes", "hostname", "restartPolicy", "securityContext",
            "terminationGracePeriodSeconds"}
POD_DROPPED = {"nodeSelector", "tolerations", "imagePullSecrets", "affinity"}
CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports", "resources",
                  "volumeMounts", "workingDir", "securityContext"}
CONTAINER_DROPPED = {"readinessProbe", "livenessProbe", "startupProbe"}


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


def _resolve_env(container: dict, meta: dict, namespace: str, secrets: Secrets) -> None:
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


def _volumes(pod: dict, secrets: Secrets, root: Path, out: Translation) -> None:
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
            out.dirs[str(folder)] = quantity_bytes(empty["sizeLimit"]) if memory else None
            volume["hostPath"] = {"path": str(folder), "type": "Directory"}
        elif "persistentVolumeClaim" not in volume:
            raise Untranslatable(f"pod {name}: volume {volume}")


def _selects(selector: dict, pod: dict) -> bool:
    labels = pod["metadata"].get("labels", {})
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def translate(docs: list[dict], *, subnet: str, root: Path, namespace: str = "default", worker_pods: int | None = None,
              publish: dict[str, int] | None = None) -> Translation:
    """`docs`: the rendered chart (and anything an operator installs beside it: a Secret, an S3
    store's Pod and Service). `subnet`: the podman network's, from whose hosts each pod gets an
    address. `root`: the folder under which Secrets' files and emptyDirs go. `worker_pods`: the
    worker group's pods (default: its `replicas`). `publish`: a Service's name -> the host port
    its first port is published on."""
    secrets, out = Secrets(docs), Translation(pods=[])
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
            out.pods.extend(ray_pods(doc, namespace, worker_pods, secrets, out))
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


def _finish_pods(out: Translation, secrets: Secrets, services: list[dict], namespace: str, publish: dict[str, int],
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
            container_port(pod["spec"]["containers"][0], port["targetPort"])["hostPort"] = publish[service["metadata"]["name"]]
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
