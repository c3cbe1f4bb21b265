"""One replica of a shard: the base model with the shard's fixed adapter set on one
device, an engine on its own thread, and the prefix cache; requests in as plain
data, deltas out as plain data (what travels through Ray Serve handles).

A delta: `token_ids`, `text`, `logprobs` ([token, logprob, [[token, logprob], ...]]
per token, or None), `finish_reason` (None until the last), `error`; the last
also carries `usage` (prompt, completion and cached tokens), `timings` and,
with echo + logprobs, `prompt_logprobs`. A request the worker refuses gets one
delta with `status` 400 and the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

import torch

from cache.prefix import PrefixCacheConfig
from gateway.config import ServeConfig
from worker.engine.engine import Engine, EngineConfig, EngineRequest
from worker.engine.loop import EngineLoop
from worker.model.loader import DeviceConfig
from worker.engine.outputs import RequestOutput, TokenLogprob
from worker.engine.params import SamplingParams
from worker.engine.prefix_kv import open_prefix_cache
from worker.engine.runner import ModelRunner
from worker.formats.tokenizer import GGUFTokenizer

log = logging.getLogger(__name__)


def _logprob(entry: TokenLogprob | None) -> list | None:
    return None if entry is None else [entry.token_id, entry.logprob, [[i, lp] for i, lp in entry.top]]


def delta_dict(out: RequestOutput) -> dict[str, Any]:
    delta: dict[str, Any] = {
        "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason, "error": out.error,
        "logprobs": [_logprob(e) for e in out.logprobs] if out.logprobs else None,
    }
    result = out.result
    if result is not None:
        delta["usage"] = {"prompt_tokens": len(result.prompt_ids), "completion_tokens": len(result.token_ids), "cached_tokens": result.cached_tokens}
        delta["timings"] = {"prompt_s": result.prompt_time_s, "decode_s": result.decode_time_s}
        if result.prompt_logprobs is not None:
            delta["prompt_logprobs"] = [_logprob(e) for e in result.prompt_logprobs]
        if result.alora_activation is not None:
            delta["alora_activation"] = result.alora_activation
    return delta


class ShardWorker:
    def __init__(self, config: ServeConfig, shard_name: str, device: str = "cpu", threads: int | None = None) -> None:
        shard = next(s for s in config.shards if s.name == shard_name)
        if threads and torch.device(device).type == "cpu":
            torch.set_num_threads(threads)
        self.shard_name = shard_name
        self.adapter_slots = {name: slot for slot, name in enumerate(shard.adapters)}
        device_config = DeviceConfig(device=device, dtype=config.engine.dtype, weights=config.engine.weights)
        self.runner = ModelRunner.from_paths(config.model_path(), [config.adapter_path(n) for n in shard.adapters], device_config)
        self.tokenizer = GGUFTokenizer(self.runner.base)
        c = config.cache
        cache_config = PrefixCacheConfig(chunk_tokens=c.chunk_tokens, l1_bytes=c.l1_bytes, redis=c.redis_config())
        self.prefix_cache = open_prefix_cache(self.runner, cache_config)
        e = config.engine
        engine_config = EngineConfig(num_slots=e.num_slots, slot_len=e.slot_len, max_step_tokens=max(e.max_step_tokens, e.num_slots))
        self.loop = EngineLoop(Engine(self.runner, self.tokenizer, engine_config, prefix_cache=self.prefix_cache))

    def request(self, call: dict[str, Any]) -> EngineRequest:
        unknown = [n for n in call["adapters"] if n not in self.adapter_slots]
        if unknown:
            raise ValueError(f"adapter {unknown[0]!r} is not on shard {self.shard_name!r}")
        params = dict(call["params"])
        params["stop"] = tuple(params.get("stop") or ())
        return EngineRequest(
            call["request_id"], list(call["prompt_ids"]), SamplingParams(**params),
            {self.adapter_slots[n]: float(s) for n, s in call["adapters"].items()},
            cache_salt=call.get("cache_salt", ""), cache_prompt=call.get("cache_prompt", True), tenant=call.get("tenant", ""),
        )

    async def generate(self, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        try:
            stream = await asyncio.to_thread(self.loop.submit, self.request(call))  # the cache lookup runs off the event loop
        except (ValueError, TypeError) as e:  # RequestError, MultipleALoRAError, bad params: the request's fault
            yield {"token_ids": [], "text": "", "finish_reason": "error", "error": str(e), "status": 400}
            return
        finished = False
        try:
            while not finished:
                out = await asyncio.to_thread(stream.get)
                finished = out.is_finished
                yield delta_dict(out)
        finally:
            if not finished:  # the caller went away (client disconnect, gateway cancel): free the KV slot now
                stream.cancel()

    def health(self) -> dict[str, Any]:
        return {"shard": self.shard_name, "adapters": list(self.adapter_slots), "pid": os.getpid(), "cache": self.prefix_cache.health()}

    def metrics(self) -> str:
        return self.prefix_cache.prometheus()

    def close(self) -> None:
        self.loop.close()
        self.prefix_cache.close()


class LocalShardPool:
    """Every replica of every shard as an in-process ShardWorker: the gateway without Ray
    (tests). A replica in `killed` fails like a dead one; one in `fail_after` dies after
    that many deltas of its next request."""

    def __init__(self, config: ServeConfig, device: str = "cpu") -> None:
        from gateway.core import replica_infos

        self.replicas = replica_infos(config)
        self.workers = {r.replica_id: ShardWorker(config, r.shard, device) for r in self.replicas}
        self.killed: set[str] = set()
        self.fail_after: dict[str, int] = {}

    async def stream(self, replica_id: str, call: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        from gateway.core import WorkerFailed

        if replica_id in self.killed:
            raise WorkerFailed(f"replica {replica_id} is dead")
        sent = 0
        async for delta in self.workers[replica_id].generate(call):
            if replica_id in self.killed or self.fail_after.get(replica_id) == sent:
                raise WorkerFailed(f"replica {replica_id} died")
            sent += 1
            yield delta

    async def health(self, replica_id: str) -> dict[str, Any]:
        if replica_id in self.killed:
            raise ConnectionError(f"replica {replica_id} is dead")
        return self.workers[replica_id].health()

    async def metrics(self, replica_id: str) -> str:
        return self.workers[replica_id].metrics()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
