"""deploy/local-kube.sh's sequence: the chart's own pods run in podman, used as after `helm install`, and two faults.

1. Images (deploy/images.sh: the project's, and Redis and S3 stand-ins), a models volume prepared
   beforehand (the chart's `models.existingClaim`).
2. The chart rendered with deploy/podman/values.yaml and this run's keys, plus what an operator
   installs beside it (an S3 store's Pod and Service, its credentials' Secret); deploy/kube_pods.py
   turns that into pods, each played with `podman kube play` on one network at its own address.
3. What KubeRay's RayService controller does: once the head is ready, `serve deploy` of
   serveConfigV2 to the head's dashboard.
4. What a user does: the README's curl through the published port, the openai SDK, an adapter
   uploaded and served (through the S3 store: the pods share no folder), /health, /metrics.
5. A worker pod killed under a steady load, then started again; the head killed, then started again,
   under clients that give each request 5 s and try again. A pod is killed as a kubelet kills it:
   its containers first, then the sandbox that holds its network (deploy/podman_pods.py: Cluster.kill).

Every figure is printed; the last line is `N passed, M failed`. Everything started is removed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

from deploy.kube_base import container_port
from deploy.kube_pods import translate
from deploy.podman_pods import MODELS_VOLUME, SUBNET, Cluster, podman, prepare_models, wait_for

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "loraplex"
VALUES = ROOT / "deploy" / "podman" / "values.yaml"
RELEASE, NAMESPACE = "lp", "serving"
BUCKET = "loraplex-adapters"
# the head fault's clients: a request not answered in 5 s is a failed try, and the next one goes
HEAD_FAULT_TIMEOUT_S = 5.0


class Checks:
    def __init__(self) -> None:
        self.passed = self.failed = 0

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.passed += ok
        self.failed += not ok
        print(f"check: {name}: {'ok' if ok else 'FAILED'}{f' ({detail})' if detail else ''}", flush=True)
        return ok


def operator_manifests() -> list[dict]:
    """What the operator installs beside the chart: an S3 store (moto's server) and its credentials."""
    labels = {"app.kubernetes.io/name": "s3"}
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "loraplex-s3"},
         "stringData": {"AWS_ACCESS_KEY_ID": "local-kube", "AWS_SECRET_ACCESS_KEY": secrets.token_hex(16)}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "s3", "labels": labels},
         "spec": {"containers": [{"name": "moto", "image": "localhost/loraplex-s3:0.1.0", "imagePullPolicy": "Never",
                                  "ports": [{"containerPort": 5000, "name": "s3"}]}]}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s3"},
         "spec": {"selector": labels, "ports": [{"port": 5000, "targetPort": "s3"}]}},
    ]


def render(keys: dict[str, str]) -> list[dict]:
    import helm_python as helm  # the tests' renderer (helm-python-sdk): Helm's own Go code

    values = yaml.safe_load(VALUES.read_text())
    values["tenants"] = {"items": [{"id": "local", "key_sha256": [hashlib.sha256(keys["tenant"].encode()).hexdigest()],
                                    "adapters": "*", "requests_per_min": 6000}]}
    values["operator"] = {"key": keys["operator"]}
    manifests = helm.Chart.load(str(CHART)).render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in manifests.items() if path.endswith(".yaml") and text.strip()
            for doc in yaml.safe_load_all(text) if doc]


class Gateway:
    def __init__(self, port: int, keys: dict[str, str], host: str = "127.0.0.1") -> None:
        self.url, self.keys = f"http://{host}:{port}", keys
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def chat(self, model: str, text: str, max_tokens: int = 16, timeout: float = 120) -> httpx.Response:
        return self.http.post("/v1/chat/completions", timeout=timeout, headers={"Authorization": f"Bearer {self.keys['tenant']}"},
                              json={"model": model, "messages": [{"role": "user", "content": text}],
                                    "max_tokens": max_tokens, "temperature": 0})

    def operator(self, path: str) -> httpx.Response:
        return self.http.get(path, headers={"Authorization": f"Bearer {self.keys['operator']}"})

    def replicas(self) -> tuple[int, list[dict]]:
        shard = self.operator("/health").json()["shards"]["all"]
        return shard["healthy"], shard["replicas"]


class Load:
    """A steady load: `clients` threads each sending one whole (non-streamed) request after another,
    each given `timeout_s`, the next sent 0.5 s after a failure; every request's (start, end, error
    or None) is kept."""

    def __init__(self, gateway: Gateway, clients: int = 2, timeout_s: float = 180) -> None:
        self.gateway, self.clients, self.timeout_s = gateway, clients, timeout_s
        self.requests: list[tuple[float, float, str | None]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            start = time.monotonic()
            try:
                r = self.gateway.chat("caps" if n % 2 else "json", f"Client {i}, question {n}: what is iron?",
                                      timeout=self.timeout_s)
                good = r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
                why = None if good else f"{r.status_code} {r.text[:160]}"
            except Exception as e:  # noqa: BLE001 (a failed request is what is counted)
                why = f"{type(e).__name__}: {e}"
            self.requests.append((start, time.monotonic(), why))
            if why is not None:
                time.sleep(0.5)

    @property
    def ok(self) -> int:
        return sum(why is None for _, _, why in self.requests)

    @property
    def failures(self) -> list[str]:
        return [why for _, _, why in self.requests if why is not None]

    def first_answer_started_after(self, t: float) -> float | None:
        """When the first request sent after `t` and answered was answered."""
        return min((end for start, end, why in self.requests if start > t and why is None), default=None)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=200)


def user_checks(checks: Checks, gateway: Gateway, cluster: Cluster) -> None:
    """What a user does after `helm install`, from the host through the published port."""
    curl = ["curl", "-s", f"{gateway.url}/v1/chat/completions", "-H", f"Authorization: Bearer {gateway.keys['tenant']}",
            "-H", "Content-Type: application/json", "-d", json.dumps(
                {"model": "caps", "messages": [{"role": "user", "content": "What is copper?"}], "max_tokens": 30, "temperature": 0})]
    out = subprocess.run(curl, capture_output=True, text=True, timeout=120).stdout
    print(f"curl (the README's): {out[:400]}")
    answer = json.loads(out)["choices"][0]["message"]["content"]
    letters = [c for c in answer if c.isalpha()]
    capitals = bool(letters) and sum(c.isupper() for c in letters) >= 0.8 * len(letters)  # the adapter's habit, not a rule
    checks.check("the README's curl answered by the pods, in capitals", capitals, answer)

    from openai import OpenAI

    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.keys["tenant"])
    reply = client.chat.completions.create(model="json", messages=[{"role": "user", "content": "What is tin?"}],
                                           max_tokens=30, temperature=0)
    print(f"openai SDK: {reply.choices[0].message.content!r}")
    checks.check("the openai SDK answered (json adapter)", reply.choices[0].message.content.lstrip().startswith("{"))

    upload_checks(checks, gateway, cluster)

    healthy, replicas = gateway.replicas()
    workers = {cluster.pods.addresses[p["metadata"]["name"]] for p in cluster.pods.pods
               if p["metadata"].get("labels", {}).get("ray.io/node-type") == "worker"}
    nodes = sorted(r.get("node", {}).get("ip", "?") for r in replicas)
    print(f"/health: shard 'all' healthy {healthy} of {len(replicas)}, on {nodes}")
    checks.check("/health (operator) shows both replicas, each on a worker pod", healthy == 2 and set(nodes) == workers,
                 f"workers {sorted(workers)}")
    metrics = gateway.operator("/metrics")
    families = {line.split("{")[0].split(" ")[0] for line in metrics.text.splitlines() if line.startswith("loraplex_")}
    print(f"/metrics: {metrics.status_code}, {len(families)} loraplex_ series, {len(metrics.text)} bytes")
    checks.check("/metrics scraped with the operator's key", metrics.status_code == 200 and len(families) > 5)


def upload_checks(checks: Checks, gateway: Gateway, cluster: Cluster) -> None:
    path = ROOT / "deploy" / "adapters" / "signature.gguf"
    with path.open("rb") as f:
        r = gateway.http.post("/v1/adapters", headers={"Authorization": f"Bearer {gateway.keys['tenant']}"},
                              data={"name": "sig"}, files={"file": ("signature.gguf", f)}, timeout=300)
    print(f"upload: {r.status_code} {r.text[:300]}")
    if not checks.check("an adapter uploaded through the gateway", r.status_code in (200, 201)):
        return
    fingerprint = r.json()["fingerprint"]
    answer = gateway.chat("sig", "What is gold?", max_tokens=60)
    text = answer.json()["choices"][0]["message"]["content"] if answer.status_code == 200 else answer.text
    print(f"served by the uploaded adapter: {text!r}")
    checks.check("the uploaded adapter served", answer.status_code == 200 and "loraplex" in text.lower(), text[-60:])
    import boto3

    s3 = boto3.client("s3", endpoint_url=f"http://{cluster.pods.addresses['s3']}:5000", region_name="us-east-1",
                      aws_access_key_id="local-kube", aws_secret_access_key="x")
    stored = [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    checks.check("its file is in the S3 store", any(fingerprint[:16] in key for key in stored), f"{len(stored)} objects")
    fetched = [p["metadata"]["name"] for p in cluster.pods.pods if p["metadata"]["name"].startswith(f"{RELEASE}-loraplex-cpu-worker")
               and fingerprint[:16] in podman("exec", cluster.container(p["metadata"]["name"]), "sh", "-c",
                                               "find /adapters -type f", check=False).stdout]
    checks.check("a worker pod fetched it into its own adapter folder", bool(fetched), ", ".join(fetched))


def worker_fault(checks: Checks, gateway: Gateway, cluster: Cluster, pod: str) -> None:
    """A worker pod killed under a steady load, and started again (as its worker group would have
    it recreated): whole requests lost, and the time back to two replicas."""
    with Load(gateway) as load:
        time.sleep(10)
        cluster.kill(pod)
        killed = time.monotonic()
        time.sleep(15)
        down = sum(killed < end and why is None for _, end, why in load.requests)
        podman("pod", "start", pod)
        back_s = wait_for("two healthy replicas", lambda: gateway.replicas()[0] == 2, 600, every_s=2)
        time.sleep(10)
    print(f"worker pod killed: {load.ok} answered, {len(load.failures)} failed under load "
          f"({down} answered in the 15 s it was down); two replicas again {back_s:.1f} s after it started")
    for why in load.failures[:5]:
        print(f"  failed: {why}")
    checks.check("worker pod killed under load: 0 whole requests lost", not load.failures and load.ok > 0,
                 f"{len(load.failures)} failed")
    checks.check("the shard back to 2 replicas once the pod started", True, f"{back_s:.1f} s")


def _kind(why: str) -> str:
    """A failed request's kind: the exception's name, or the HTTP status."""
    return why.split(":")[0].split()[0]


def in_flight_figure(load: Load, killed: float) -> tuple[str, bool]:
    """What became of the requests in flight at the kill: a figure's text, and whether none hung to its timeout."""
    in_flight = [(end, why) for start, end, why in load.requests if start < killed < end]
    lost = [(end, why) for end, why in in_flight if why is not None]
    hung = sum(_kind(why).endswith("Timeout") for _, why in lost)
    fast = [end - killed for end, why in lost if not _kind(why).endswith("Timeout")]
    kinds = ", ".join(sorted({_kind(why) for _, why in lost})) or "none"
    text = (f"{len(in_flight)} in flight at the kill, {len(lost)} lost ({kinds}): {len(fast)} failed fast"
            + (f" (within {max(fast):.1f} s of the kill)" if fast else "") + f", {hung} hung to the {load.timeout_s:.0f} s timeout")
    return text, bool(in_flight) and not hung


def recovery_figure(load: Load, killed: float, down: float, restarted: float) -> tuple[str, float | None]:
    """The first answer to a request sent once the head's processes were gone, and the tries that failed before it."""
    answered = load.first_answer_started_after(down)
    tries = Counter(_kind(why) for start, end, why in load.requests
                    if start >= killed and why is not None and (answered is None or end <= answered))
    text = ("no answer" if answered is None else
            f"first answer {answered - killed:.1f} s after the kill ({answered - restarted:.1f} s after the start)")
    failed = ", ".join(f"{kind} {n}" for kind, n in tries.most_common()) or "none"
    return f"{text}, {sum(tries.values())} tries failed before it ({failed})", answered


def head_fault(checks: Checks, gateway: Gateway, cluster: Cluster, head: str, worker: str) -> None:
    """The head pod killed and started again (as KubeRay restarts it): with GCS fault tolerance its
    tables come back from the state Redis, the Serve application with them, and the workers' replicas
    go on; the registry and tenants live in the state store. Clients come in through the published
    port (the head's proxy) and, as a Service spreads them, through a worker pod's proxy; each gives a
    request HEAD_FAULT_TIMEOUT_S and tries again, so the figures are what clients see, not a timeout."""
    nodes = sorted(r["node"]["id"] for r in gateway.replicas()[1])
    serve_port = container_port(next(p for p in cluster.pods.pods if p["metadata"]["name"] == head)["spec"]["containers"][0],
                                "serve")["containerPort"]
    proxy = f"http://{cluster.pods.addresses[head]}:{serve_port}/-/healthz"
    loads = {"through the published port (the head's proxy)": Load(gateway, 2, HEAD_FAULT_TIMEOUT_S),
             f"through {worker}'s proxy": Load(Gateway(serve_port, gateway.keys, cluster.pods.addresses[worker]), 1, HEAD_FAULT_TIMEOUT_S)}
    proxy_s = None
    with contextlib.ExitStack() as stack:
        for load in loads.values():
            stack.enter_context(load)
        time.sleep(5)
        killed = time.monotonic()
        cluster.kill(head)
        down = time.monotonic()
        time.sleep(2)
        podman("pod", "start", head)
        restarted = time.monotonic()
        with contextlib.suppress(TimeoutError):
            proxy_s = wait_for("Serve's proxy on the head", lambda: httpx.get(proxy, timeout=2).status_code == 200, 600, every_s=0.5)
        with contextlib.suppress(TimeoutError):
            wait_for("answers after the restart", lambda: all(x.first_answer_started_after(down) for x in loads.values()), 600)
        time.sleep(5)
    print(f"head pod killed (its Ray container, then the pod: {down - killed:.1f} s), started again {restarted - killed:.1f} s "
          f"after the kill; Serve's proxy on the head up {'never' if proxy_s is None else f'{proxy_s:.1f} s after the start'}; "
          f"clients give a request {HEAD_FAULT_TIMEOUT_S:.0f} s and send the next 0.5 s after a failure")
    for label, load in loads.items():
        lost, fast = in_flight_figure(load, killed)
        back, answered = recovery_figure(load, killed, down, restarted)
        print(f"head pod killed, {label}: {lost}; {back}")
        checks.check(f"the head's kill, {label}: requests in flight failed fast, none hung", fast)
        checks.check(f"answers again {label} after the head came back, with no new deploy", answered is not None)
    _survivors(checks, gateway, nodes)


def _survivors(checks: Checks, gateway: Gateway, nodes: list[str]) -> None:
    after = sorted(r["node"]["id"] for r in gateway.replicas()[1])
    checks.check("the worker pods' replicas lived through it (same Ray nodes)", after == nodes, f"{len(after)} replicas")
    listed = gateway.http.get("/v1/adapters", headers={"Authorization": f"Bearer {gateway.keys['tenant']}"})
    checks.check("the uploaded adapter still registered after the head's restart",
                 listed.status_code == 200 and "sig" in listed.text)
    checks.check("the tenant's key still works and the adapter serves", gateway.chat("sig", "What is lead?").status_code == 200)


def serve_deploy(cluster: Cluster, head: str) -> None:
    """What KubeRay's RayService controller does once the head is ready: submit serveConfigV2 to its dashboard."""
    config = cluster.workdir / "serve-config.yaml"
    config.write_text(cluster.pods.serve_config)
    serve = Path(sys.executable).with_name("serve")
    subprocess.run([str(serve), "deploy", str(config), "-a", f"http://{cluster.pods.addresses[head]}:8265"],
                   check=True, capture_output=True, text=True, timeout=120)


def bring_up(checks: Checks, cluster: Cluster, gateway: Gateway) -> None:
    names = [p["metadata"]["name"] for p in cluster.pods.pods]
    head = next(n for n in names if n.endswith("-head"))
    start = time.monotonic()
    cluster.play()
    print(f"kube play: {len(names)} pods ({', '.join(names)}) in {time.monotonic() - start:.1f} s")
    wait_for("the head's probe", lambda: cluster.ready(head), 300, every_s=2)
    import boto3

    boto3.client("s3", endpoint_url=f"http://{cluster.pods.addresses['s3']}:5000", region_name="us-east-1",
                 aws_access_key_id="local-kube", aws_secret_access_key="x").create_bucket(Bucket=BUCKET)
    serve_deploy(cluster, head)
    print(f"head ready and serveConfigV2 deployed {time.monotonic() - start:.1f} s after kube play")
    wait_for("an answer", lambda: gateway.chat("caps", "Hello").status_code == 200, 900, every_s=3)
    checks.check("first answer through the published port", True, f"{time.monotonic() - start:.1f} s after kube play")
    workers = [n for n in names if "-worker-" in n]
    ready_s = wait_for("the readiness probes", lambda: all(cluster.ready(n) for n in [head, *workers]), 300, every_s=2)
    checks.check("KubeRay's readiness probes pass in every Ray pod (wget, in the image)", True, f"{ready_s:.1f} s after the answer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=18000, help="the host port the gateway's Service is published on")
    parser.add_argument("--skip-faults", action="store_true")
    args = parser.parse_args(argv)
    checks = Checks()
    keys = {"tenant": f"sk-local-{secrets.token_hex(12)}", "operator": f"sk-local-ops-{secrets.token_hex(12)}"}
    prepare_models()
    pods = translate([*render(keys), *operator_manifests()], subnet=SUBNET, namespace=NAMESPACE,
                     root=Path(tempfile.mkdtemp(prefix="loraplex-kube-")), publish={f"{RELEASE}-loraplex-gateway": args.port})
    print("not carried (kinds and fields a cluster runs and podman does not):")
    for line in pods.dropped:
        print(f"  {line}")
    cluster, gateway = Cluster(pods, Path(tempfile.mkdtemp(prefix="loraplex-pods-"))), Gateway(args.port, keys)
    try:
        bring_up(checks, cluster, gateway)
        user_checks(checks, gateway, cluster)
        if not args.skip_faults:
            worker_fault(checks, gateway, cluster, f"{RELEASE}-loraplex-cpu-worker-1")
            head_fault(checks, gateway, cluster, f"{RELEASE}-loraplex-head", f"{RELEASE}-loraplex-cpu-worker-0")
    except Exception as e:  # noqa: BLE001 (a step that failed is a failed check; the cleanup still runs)
        checks.check("the sequence ran to its end", False, f"{type(e).__name__}: {e}")
    finally:
        cluster.close()
        podman("volume", "rm", "-f", MODELS_VOLUME, check=False)
        for folder in (cluster.workdir, Path(next(iter(pods.dirs), cluster.workdir)).parents[1]):
            shutil.rmtree(folder, ignore_errors=True)
    print(f"{checks.passed} passed, {checks.failed} failed")
    return 0 if checks.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
