"""A private redis-server on a free port, for tests that stop and restart Redis."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis

from bench.cluster import free_port


class RedisServer:
    """`args`: more of redis-server's options (its defaults here: no persistence)."""

    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt install redis-server)")
        self.binary, self.port, self.args = binary, port or free_port(), tuple(args)
        self.process: subprocess.Popen | None = None
        self._cwd: str | None = None  # redis-server's own files (a CONFIG SET appendonly writes there), never the repo's

    @classmethod
    def durable(cls, directory, port: int | None = None) -> RedisServer:
        """A state store as production runs one: AOF in `directory`, never evicting."""
        return cls(port, ("--appendonly", "yes", "--appendfsync", "always", "--dir", str(directory),
                          "--maxmemory-policy", "noeviction"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", *self.args]
        self._cwd = self._cwd or tempfile.mkdtemp(prefix="redis-test-")
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self._cwd)
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)
            self.process = None
        if self._cwd is not None:
            shutil.rmtree(self._cwd, ignore_errors=True)
            self._cwd = None
