"""`loraplex serve` as a child process for the benchmarks: started from a config mapping,
ready when it says so, its output drained (a full pipe would block it), stopped as Ctrl-C
does; and the memory of every process it started (the driver, Ray's, the replicas)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil  # a Ray dependency
import yaml

ROOT = Path(__file__).resolve().parent.parent


class ServeFailed(RuntimeError):
    """`loraplex serve` exited or did not say it was ready in time (its output says why)."""


class Server:
    """`loraplex serve` of `config` on `port`, reached at `url_host` (the machine's loopback unless
    told), with `env` for its environment (this process's unless told); in a session of its own,
    so that stopping it can end everything it started."""

    def __init__(self, config: dict, base: Path, port: int, timeout_s: float = 600.0, env: dict[str, str] | None = None,
                 url_host: str = "127.0.0.1") -> None:
        path = base / f"serve-{uuid.uuid4().hex[:6]}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://{url_host}:{port}"
        self.output: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        for line in self.process.stdout:
            self.output.append(line)
            if "ready in" in line:
                break
            if time.monotonic() > deadline:
                self._kill()
                raise ServeFailed("the server did not start in time:\n" + "".join(self.output))
        else:
            self._kill()
            raise ServeFailed("the server exited:\n" + "".join(self.output))
        self._drain = threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True)
        self._drain.start()

    def rss_bytes(self) -> dict[int, tuple[str, int]]:
        """pid -> (command, resident bytes) of the server and every process under it."""
        out = {}
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                try:
                    out[proc.pid] = (" ".join(proc.cmdline())[:80], proc.memory_info().rss)
                except psutil.Error:  # gone meanwhile
                    continue
        except psutil.Error:
            pass
        return out

    def stop(self, timeout_s: float = 120.0) -> bool:
        """Stop it as Ctrl-C does; whether it did so within `timeout_s` (else it and everything it
        started are killed). Its output is all in `output` then."""
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
            stopped = True
        except subprocess.TimeoutExpired:
            self._kill()
            stopped = False
        self._drain.join(10)
        return stopped

    def _kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)


def base_config(prefix: str) -> dict:
    """deploy/serve.yaml with absolute adapter paths and a cache namespace of its own."""
    config = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    for adapter in config["adapters"]:
        adapter["path"] = str(ROOT / "deploy" / adapter["path"])
    config["cache"]["key_prefix"] = prefix
    return config


def delete_keys(client, prefix: str) -> None:
    """Remove what a benchmark stored under its own key prefix in the machine's Redis."""
    stale = list(client.scan_iter(f"{prefix}*"))
    for start in range(0, len(stale), 512):
        client.delete(*stale[start : start + 512])


def loadtest(scenario: Path, url: str, out: Path, *, duration_s: float | None = None, seed: int | None = None,
             max_requests: int | None = None) -> Path:
    """`loraplex loadtest` of `scenario` against the server at `url`, its report in `out`; the report's path."""
    command = [sys.executable, "-m", "gateway.cli", "loadtest", "--scenario", str(scenario), "--url", url, "--out", str(out),
               "--quiet"]
    for flag, value in (("--duration", duration_s), ("--seed", seed), ("--max-requests", max_requests)):
        if value is not None:
            command += [flag, str(value)]
    subprocess.run(command, check=True, capture_output=True, text=True)
    return out / "report.json"
