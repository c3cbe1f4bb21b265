"""A gateway over in-process workers on a tiny model: the config and helpers the gateway tests share."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import openai
import redis
import redis.asyncio

from gateway.api.app import create_app
from gateway.catalog import Catalog
from gateway.compose import Gateway
from gateway.config import parse_config
from gateway.tenancy.ratelimit import RateLimiter
from tests.tinymodels import TinyModel, invocation_metadata, random_lora, write_adapter

ATTN = ["blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.1.attn_output.weight"]
INVOCATION = [250, 12]
KEYS = {"t1": "key-one", "t2": "key-two", "shared": "key-shared", "shared2": "key-shared-2", "limited": "key-limited",
        "thrifty": "key-thrifty", "operator": "key-operator"}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def tiny_config(model: TinyModel, directory: Path, prefix: str, **overrides):
    alora = invocation_metadata(INVOCATION)
    for name, seed, meta in (("a", 1, None), ("b", 2, None), ("alo", 3, alora), ("alo2", 4, alora)):
        write_adapter(directory / f"{name}.gguf", random_lora(model, ATTN, 4, seed=seed), metadata=meta)
    data = {
        "model": str(model.path), "model_name": "tiny",
        "adapters": [{"name": n, "path": f"{n}.gguf"} for n in ("a", "b", "alo", "alo2")],
        "shards": [{"name": "s1", "adapters": ["a", "alo", "alo2"], "replicas": 2}, {"name": "s2", "adapters": ["b", "a"]}],
        "tenants": [
            {"id": "t1", "key_sha256": [digest(KEYS["t1"])]},
            {"id": "t2", "key_sha256": [digest(KEYS["t2"])], "adapters": ["b"]},
            {"id": "limited", "key_sha256": [digest(KEYS["limited"])], "requests_per_min": 2, "tokens_per_min": 100},
            {"id": "thrifty", "key_sha256": [digest(KEYS["thrifty"])], "tokens_per_min": 100},
            {"id": "shared", "key_sha256": [digest(KEYS["shared"])], "shared_cache": True},
            {"id": "shared2", "key_sha256": [digest(KEYS["shared2"])], "shared_cache": True},
        ],
        "operator_key_sha256": [digest(KEYS["operator"])],
        "cache": {"key_prefix": prefix, "chunk_tokens": 8},
        "engine": {"num_seq_slots": 4, "max_step_tokens": 64},
        "http": {"max_body_bytes": 4096},
        "registry": {"store_dir": str(directory / "store"), "poll_interval_s": 0.2},
        "routing": {"unresponsive_after_s": 2.0},  # how long a request waits for a replica to be reachable again
        "state": {"ephemeral": True},  # the machine's Redis (no persistence) keeps the tests' state
        **overrides,
    }
    return parse_config(data, directory)


def local_app(config, worker_config=None):
    """The app over in-process torch workers (end to end, without Ray); the workers are built from
    `worker_config` when given (another node's settings: e.g. its own adapter-store cache)."""
    from tests.gateway.local_pool import LocalShardPool

    pool = LocalShardPool(worker_config or config)
    limiter = RateLimiter(redis.asyncio.Redis(socket_timeout=1), config.cache.redis.key_prefix)
    app = create_app()
    app.state.gateway = Gateway(config, Catalog(config), pool, limiter)
    return app, pool


@contextlib.contextmanager
def local_serving(config, worker_config=None) -> Iterator[tuple]:
    """`local_app`'s app and pool; afterwards the workers closed and every Redis key under the config's prefix deleted."""
    app, pool = local_app(config, worker_config)
    try:
        yield app, pool
    finally:
        pool.close()
        r = redis.Redis()
        for key in r.scan_iter(f"{config.cache.redis.key_prefix}:*"):
            r.delete(key)


PROMPT = [(5 * i + 7) % 240 for i in range(30)]
SCHEMA = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "more": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
          "required": ["pick", "n", "more"], "additionalProperties": False}


def api(client, key="t1") -> openai.OpenAI:
    """The openai client over an in-process app's TestClient, as tenant `key`."""
    return openai.OpenAI(base_url="http://testserver/v1", api_key=KEYS[key], http_client=client, max_retries=0)


def auth(key="t1") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}
