"""The registry's records and where they are kept (torch-free).

A record is one tenant's name for one adapter content (its fingerprint) and where it is
placed. Every change is one transaction over the whole set, so a quota is checked
against what is there and a replace moves a name atomically. Each change bumps a version
number: gateway replicas poll it to see changes, and workers ignore a pin set older than
the one they hold.

Kept in Redis (a hash of records and a version counter, under the deployment's key
prefix) when the deployment has one, shared by every gateway replica; otherwise in a
JSON file beside the adapter files, under a file lock (one machine).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

SHARED = ""  # the owner of adapters every tenant allowed "*" may use (the operator's, and the config's)

Records = dict[str, "AdapterRecord"]
Change = Callable[[Records], tuple[dict[str, "AdapterRecord | None"], Any]]  # records -> (key -> new record or None to delete, result)


class RegistryUnavailable(RuntimeError):
    """The registry's store (Redis) cannot be reached: changes are refused, serving goes on."""


@dataclass(frozen=True)
class AdapterRecord:
    owner: str  # tenant id, or SHARED
    name: str
    fingerprint: str
    size_bytes: int
    rank: int
    targets: tuple[str, ...]  # the kinds of tensors it adapts (attn_q, ffn_down, ...)
    alpha: float = 0.0
    invocation_tokens: tuple[int, ...] | None = None
    task_name: str | None = None
    prompt_prefix: str | None = None
    created_s: float = 0.0
    shards: tuple[str, ...] = field(default=())  # where it is pinned

    @property
    def key(self) -> str:
        return record_key(self.owner, self.name)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> AdapterRecord:
        data = json.loads(text)
        data["targets"] = tuple(data.get("targets") or ())
        data["shards"] = tuple(data.get("shards") or ())
        if data.get("invocation_tokens") is not None:
            data["invocation_tokens"] = tuple(data["invocation_tokens"])
        return cls(**data)


def record_key(owner: str, name: str) -> str:
    return f"{owner}/{name}"  # neither a tenant id nor a name holds '/'


class RecordStore(Protocol):
    async def version(self) -> int: ...

    async def load(self) -> tuple[int, Records]: ...

    async def transact(self, change: Change) -> tuple[int, Any]:
        """Apply `change` to the current records atomically; (the new version, its result)."""

    async def lease(self, name: str, ttl_s: float) -> bool:
        """True for one caller per `ttl_s` (the gateway replicas take turns at a periodic job)."""


class RedisRecords:
    def __init__(self, client, key_prefix: str) -> None:
        self.client = client
        self.records_key, self.version_key = f"{key_prefix}registry:records", f"{key_prefix}registry:version"

    async def version(self) -> int:
        from redis.exceptions import RedisError

        try:
            return int(await self.client.get(self.version_key) or 0)
        except (RedisError, OSError) as e:
            raise RegistryUnavailable(f"the adapter registry (Redis) is unavailable: {type(e).__name__}") from e

    async def load(self) -> tuple[int, Records]:
        from redis.exceptions import RedisError

        try:
            async with self.client.pipeline(transaction=True) as pipe:
                version, raw = await pipe.get(self.version_key).hgetall(self.records_key).execute()
        except (RedisError, OSError) as e:
            raise RegistryUnavailable(f"the adapter registry (Redis) is unavailable: {type(e).__name__}") from e
        return int(version or 0), _decode(raw)

    async def lease(self, name: str, ttl_s: float) -> bool:
        from redis.exceptions import RedisError

        try:
            return bool(await self.client.set(f"{self.version_key}:lease:{name}", b"1", nx=True, px=max(1, int(ttl_s * 1000))))
        except (RedisError, OSError) as e:
            raise RegistryUnavailable(f"the adapter registry (Redis) is unavailable: {type(e).__name__}") from e

    async def transact(self, change: Change) -> tuple[int, Any]:
        from redis.exceptions import RedisError, WatchError

        try:
            async with self.client.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(self.version_key)  # every writer bumps it
                        records = _decode(await pipe.hgetall(self.records_key))
                        changes, result = change(records)
                        pipe.multi()
                        for key, record in changes.items():
                            if record is None:
                                pipe.hdel(self.records_key, key)
                            else:
                                pipe.hset(self.records_key, key, record.to_json())
                        pipe.incr(self.version_key)
                        return (await pipe.execute())[-1], result
                    except WatchError:  # another gateway changed it meanwhile: again, on what is there now
                        continue
        except (RedisError, OSError) as e:  # a refusal from `change` itself goes to the caller as it is
            raise RegistryUnavailable(f"the adapter registry (Redis) is unavailable: {type(e).__name__}") from e


class FileRecords:
    """One JSON file, changed under an exclusive lock (every process on this machine)."""

    def __init__(self, directory: Path, scope: str = "") -> None:
        name = f"registry-{scope}" if scope else "registry"
        self.path, self.lock_path = directory / f"{name}.json", directory / f"{name}.lock"

    def _read(self) -> tuple[int, Records]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 0, {}
        return int(data["version"]), {k: AdapterRecord.from_json(json.dumps(v)) for k, v in data["records"].items()}

    def _locked(self, fn: Callable[[], Any]) -> Any:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.lock_path, "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                return fn()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    async def version(self) -> int:
        return (await self.load())[0]

    async def lease(self, name: str, ttl_s: float) -> bool:
        return True  # one machine, one gateway

    async def load(self) -> tuple[int, Records]:
        return await asyncio.to_thread(self._locked, self._read)

    async def transact(self, change: Change) -> tuple[int, Any]:
        def apply() -> tuple[int, Any]:
            version, records = self._read()
            changes, result = change(dict(records))
            for key, record in changes.items():
                if record is None:
                    records.pop(key, None)
                else:
                    records[key] = record
            data = {"version": version + 1, "records": {k: json.loads(r.to_json()) for k, r in records.items()}}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, self.path)
            return version + 1, result

        return await asyncio.to_thread(self._locked, apply)


def _decode(raw: dict) -> Records:
    out = {}
    for key, value in raw.items():
        key = key.decode() if isinstance(key, bytes) else key
        out[key] = AdapterRecord.from_json(value)
    return out
