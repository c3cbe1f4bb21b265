"""What deploy/kube_pods.py and deploy/kuberay.py share: the result of a translation, the error for
what cannot be translated, a manifest's Secrets, and Kubernetes' quantities and ports."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any

import yaml


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


class Secrets:
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


def quantity_bytes(quantity: str) -> str:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9}
    match = re.fullmatch(r"(\d+)([A-Za-z]*)", str(quantity))
    if not match or (match.group(2) and match.group(2) not in units):
        raise Untranslatable(f"memory quantity {quantity}")
    return str(int(match.group(1)) * units.get(match.group(2), 1))


def quantity_cpus(quantity: Any) -> int:
    text = str(quantity)
    return int(text[:-1]) // 1000 if text.endswith("m") else int(float(text))


def container_port(container: dict, target: Any) -> dict:
    for port in container.get("ports", []):
        if target in (port.get("name"), port.get("containerPort")):
            return port
    raise Untranslatable(f"container {container['name']} has no port {target}")
