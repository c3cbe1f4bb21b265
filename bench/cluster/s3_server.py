"""An S3-compatible server (moto's `moto_server`, from `moto[server]`) on a free port of a given
address, for the blob store's tests and the multi-node test and benchmark; stopped by its process."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.cluster import free_port

START_TIMEOUT_S = 30.0


class S3Server:
    def __init__(self, host: str = "127.0.0.1") -> None:
        binary = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        if not Path(binary).exists():
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        self.binary, self.host, self.port = binary, host, free_port()
        self.process: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS variables a client of this server needs (the credentials are moto's: any will do)."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> S3Server:
        self.process = subprocess.Popen([self.binary, "-H", self.host, "-p", str(self.port)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
            self.process = None
