"""`loraplex serve` starts and stops like a cluster citizen: on SIGTERM or Ctrl-C, while its
replicas are still loading too, it takes the local Ray it started with it (a Kubernetes pod or
systemd stopping it early, a user who changes their mind; before, SIGTERM killed the driver at
once and left Ray's processes running, and a SIGINT that came in ignored, as a server started
in the background by a script gets it, was lost); a request in flight is drained and it exits
within STOP_BOUND_S (before: 27 s once a request had opened the gateway's channels, which Serve
waited out as requests in flight); an old `ray start`'s address file naming a dead cluster does
not make it wait on that cluster; and one that joined a cluster leaves it running, with its
replicas spread over the cluster's nodes.

The Rays these tests start live in a temp dir of their own (RAY_TMPDIR), so the stale address
file is written there, where Ray looks for it, and never in the machine's /tmp/ray, which other
Ray users of the machine read; the cluster they start is stopped by pid, never by `ray stop`."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.gateway.gateway_setup import digest
from tests.redis_server import free_port

STOP_BOUND_S = 15.0  # measured ~4 s, plus a drained request's time, on 2 busy cores
START_TIMEOUT_S = 240.0
OPERATOR_KEY = "sk-test-operator"
RAY = str(Path(sys.executable).with_name("ray"))


def serve_config(port: int, replicas: int = 1) -> dict:
    return {"model": None, "adapters": [], "shards": [{"name": "base", "adapters": [], "replicas": replicas}],
            "cache": {"redis_url": None}, "http": {"host": "127.0.0.1", "port": port}, "state": {"ephemeral": True}, "auth": "none",
            "operator_key_sha256": [digest(OPERATOR_KEY)]}


@pytest.fixture
def ray_tmpdir() -> Iterator[Path]:
    """A Ray temp dir of the test's own, short enough for Ray's unix socket paths."""
    path = Path(tempfile.mkdtemp(prefix="lpx", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Serve:
    """`loraplex serve` as a subprocess in its own session, its output read on a thread."""

    def __init__(self, config: dict, directory: Path, env: dict[str, str] | None = None, ignore_sigint: bool = False) -> None:
        path = directory / "serve.yaml"
        path.write_text(yaml.safe_dump(config))
        command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)]
        if ignore_sigint:  # as a shell starts a background job: SIGINT ignored across exec
            command = ["sh", "-c", "trap '' INT; exec \"$@\"", "sh", *command]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, env=env)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            if self.process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"loraplex serve never printed {text!r}:\n{self.output}")
            time.sleep(0.2)

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 90) -> float:
        """Send `sig`; the seconds until the process exited."""
        started = time.monotonic()
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"loraplex serve did not stop within {timeout_s} s:\n{self.output}")
        self._reader.join(10)
        return time.monotonic() - started

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@contextlib.contextmanager
def serving(*args, **kwargs) -> Iterator[Serve]:
    serve = Serve(*args, **kwargs)
    try:
        yield serve
    finally:
        serve.kill()


@pytest.mark.parametrize("how", ["sigterm", "sigint-ignored-at-start"])
def test_a_stop_while_deploying_shuts_everything_down(tmp_path, how) -> None:
    with serving(serve_config(free_port()), tmp_path, ignore_sigint=how == "sigint-ignored-at-start") as serve:
        serve.wait_for("deploying")  # Ray and its processes are up, the replicas load
        ray_processes = psutil.Process(serve.process.pid).children(recursive=True)
        assert ray_processes
        serve.stop(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        assert serve.process.returncode in (130, 0), serve.output
    assert "shutting down" in serve.output
    assert_gone(ray_processes)


def test_ctrl_c_drains_the_request_in_flight_and_exits_within_the_bound(tmp_path, ray_tmpdir) -> None:
    port = free_port()
    with serving(serve_config(port), tmp_path, env={**os.environ, "RAY_TMPDIR": str(ray_tmpdir)}) as serve:
        serve.wait_for("ready in")
        ray_processes = psutil.Process(serve.process.pid).children(recursive=True)
        body = {"prompt": "What is copper?", "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as response:
            events = response.iter_lines()
            first = next(line for line in events if line.startswith("data: "))  # the request is in flight
            stop_s: list[float] = []
            stopper = threading.Thread(target=lambda: stop_s.append(serve.stop()))
            stopper.start()
            rest = [line for line in events if line.startswith("data: ")]
        stopper.join(STOP_BOUND_S * 2)
    chunks = [json.loads(line[6:]) for line in [first, *rest] if line != "data: [DONE]"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and rest[-1] == "data: [DONE]"  # drained, not cut
    assert serve.process.returncode == 0, serve.output
    assert stop_s and stop_s[0] < STOP_BOUND_S, (stop_s, serve.output)
    assert "graceful_shutdown failed" not in serve.output
    assert_gone(ray_processes)


def test_a_stale_address_file_from_an_old_ray_start_does_not_stop_a_plain_serve(tmp_path, ray_tmpdir) -> None:
    (ray_tmpdir / "ray").mkdir()
    (ray_tmpdir / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")  # a cluster long gone
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmpdir), "RAY_ADDRESS": ""}
    with serving(serve_config(free_port()), tmp_path, env=env) as serve:
        serve.wait_for("ready in")  # before: ray.init() tried that address for minutes
        assert "starting a local Ray" in serve.output
        ray_processes = psutil.Process(serve.process.pid).children(recursive=True)
        assert serve.stop() < STOP_BOUND_S and serve.process.returncode == 0, serve.output
    assert_gone(ray_processes)


class RayCluster:
    """A head and a worker node started with `ray start` in a temp dir of their own, with token
    authentication; stopped by the pids of their processes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = secrets.token_hex(16)
        self.env = {**os.environ, "RAY_TMPDIR": str(root), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._ray("start", "--head", "--port", str(self.port), "--num-cpus", "2", "--disable-usage-stats",
                  "--include-dashboard", "false", "--ray-client-server-port", str(free_port()))
        self._ray("start", "--address", self.address, "--num-cpus", "2", "--disable-usage-stats")

    def _ray(self, *args: str) -> None:
        done = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster: those naming its temp dir, and theirs (the workers)."""
        marker = f"{self.root}/ray/"
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if any(marker in part for part in process.info["cmdline"] or ()):
                    for p in (process, *process.children(recursive=True)):
                        found[p.pid] = p
        return list(found.values())

    def probe(self) -> dict:
        """What a new driver sees: the alive nodes and Serve's applications."""
        script = ("import json, ray; from ray import serve; ray.init(address=%r, logging_level='ERROR'); "
                  "print(json.dumps({'nodes': sum(n['Alive'] for n in ray.nodes()), 'apps': sorted(serve.status().applications)}))")
        done = subprocess.run([sys.executable, "-c", script % self.address], env={**self.env, "RAY_ADDRESS": ""},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    def stop(self) -> None:
        processes = self.processes()
        for p in processes:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(processes, timeout=15)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_a_serve_that_joined_a_cluster_spreads_its_replicas_and_leaves_the_cluster_running(tmp_path, ray_tmpdir) -> None:
    cluster = RayCluster(ray_tmpdir)
    try:
        port = free_port()
        env = {**{k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"},  # serve turns token mode on itself
               "RAY_TMPDIR": str(ray_tmpdir), "RAY_AUTH_TOKEN": cluster.token, "RAY_ADDRESS": cluster.address}
        with serving(serve_config(port, replicas=2), tmp_path, env=env) as serve:
            serve.wait_for("ready in")
            assert f"joining the Ray cluster at {cluster.address}" in serve.output
            health = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Authorization": f"Bearer {OPERATOR_KEY}"},
                               timeout=30).json()
            nodes = [r["node"] for r in health["shards"]["base"]["replicas"]]
            assert len({n["id"] for n in nodes}) == 2 and all(n["ip"] for n in nodes), health  # a replica on each node
            assert serve.stop() < STOP_BOUND_S and serve.process.returncode == 0, serve.output
            assert "graceful_shutdown failed" not in serve.output
        assert cluster.probe() == {"nodes": 2, "apps": []}  # running, without our application
        deadline = time.monotonic() + 30  # Serve ran no application before ours: its controller went too
        while any("ServeController" in name_of(p) for p in cluster.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any("ServeController" in name_of(p) for p in cluster.processes())
    finally:
        cluster.stop()
    assert not cluster.processes()


def name_of(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def assert_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while any(map(alive, processes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(alive, processes)), [p.pid for p in processes if alive(p)]


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
