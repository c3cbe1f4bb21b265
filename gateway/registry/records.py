"""The registry's records and where they are kept (torch-free).

A record is one tenant's name for one adapter content (its fingerprint) and where it is
placed. Every change is one transaction over the whole set, so a quota is checked
against what is there and a replace moves a name atomically. Each change bumps a version
number: gateway replicas poll it to see changes, and workers ignore a pin set older than
the one they hold.

Kept in Redis (a hash of records and a version counter, under the deployment's key
prefix) when the deployment has one, shared by every gateway replica, with a copy of
every committed state in a JSON file beside the adapter files: a Redis that restarts
empty (the cache's Redis need not persist anything) gets the registry back from it.
Without Redis, that JSON file is the registry, changed under a file lock (one machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)
SHARED = ""  # the owner of adapters every tenant allowed "*" may use (the operator's, and the config's)

Records = dict[str, "AdapterRecord"]
# records -> (key -> new record or None to delete, result)
Change = Callable[[Records], tuple[dict[str, "AdapterRecord | None"], Any]]


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
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterRecord:
        data = dict(data)
        data["targets"] = tuple(data.get("targets") or ())
        data["shards"] = tuple(data.get("shards") or ())
        if data.get("invocation_tokens") is not None:
            data["invocation_tokens"] = tuple(data["invocation_tokens"])
        return cls(**data)


def _unavailable(e: Exception) -> RegistryUnavailable:
    return RegistryUnavailable(f"the adapter registry (Redis) is unavailable: {type(e).__name__}")


def _applied(records: Records, changes: dict[str, AdapterRecord | None]) -> Records:
    """`records` with `changes` made (None deletes)."""
    after = {k: r for k, r in records.items() if k not in changes}
    after.update((k, r) for k, r in changes.items() if r is not None)
    return after


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (every process on this machine)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
    def __init__(self, client, key_prefix: str, mirror: Path | None = None) -> None:
        self.client = client
        self.records_key, self.version_key = f"{key_prefix}registry:records", f"{key_prefix}registry:version"
        self.mirror = mirror

    async def version(self) -> int:
        from redis.exceptions import RedisError

        try:
            raw = await self.client.get(self.version_key)
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e
        return int(raw) if raw is not None else await self._restore()

    async def load(self) -> tuple[int, Records]:
        from redis.exceptions import RedisError

        try:
            async with self.client.pipeline(transaction=True) as pipe:
                version, raw = await pipe.get(self.version_key).hgetall(self.records_key).execute()
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e
        if version is None and await self._restore():
            return await self.load()
        return int(version or 0), _decode(raw)

    async def _restore(self) -> int:
        """Redis has no registry (it restarted empty): put the mirror's back, once, under a
        version above any a worker has seen. 0 when there is nothing to restore."""
        from redis.exceptions import RedisError, WatchError

        if self.mirror is None:
            return 0
        try:
            version, records = FileRecords.read(self.mirror)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("the registry's mirror %s cannot be read: %s", self.mirror, e)
            return 0
        if version == 0:
            return 0
        try:
            async with self.client.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(self.version_key)
                    if await pipe.get(self.version_key) is not None:  # another gateway restored it meanwhile
                        return int(await self.client.get(self.version_key) or 0)
                    pipe.multi()
                    for key, record in records.items():
                        pipe.hset(self.records_key, key, record.to_json())
                    pipe.set(self.version_key, version + 1)
                    await pipe.execute()
                except WatchError:
                    return int(await self.client.get(self.version_key) or 0)
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e
        log.warning("the registry was missing from Redis: restored %d record(s) from %s", len(records), self.mirror)
        return version + 1

    async def lease(self, name: str, ttl_s: float) -> bool:
        from redis.exceptions import RedisError

        try:
            lease_ms = max(1, int(ttl_s * 1000))
            return bool(await self.client.set(f"{self.version_key}:lease:{name}", b"1", nx=True, px=lease_ms))
        except (RedisError, OSError) as e:
            raise _unavailable(e) from e

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
                        version = (await pipe.execute())[-1]
                        break
                    except WatchError:  # another gateway changed it meanwhile: again, on what is there now
                        continue
        except (RedisError, OSError) as e:  # a refusal from `change` itself goes to the caller as it is
            raise _unavailable(e) from e
        if self.mirror is not None:
            try:
                await asyncio.to_thread(FileRecords.write_if_newer, self.mirror, version, _applied(records, changes))
            except OSError as e:
                log.warning("the registry's mirror %s cannot be written: %s", self.mirror, e)
        return version, result


class FileRecords:
    """One JSON file, changed under an exclusive lock (every process on this machine)."""

    def __init__(self, directory: Path, scope: str = "") -> None:
        name = f"registry-{scope}" if scope else "registry"
        self.path, self.lock_path = directory / f"{name}.json", directory / f"{name}.lock"

    @staticmethod
    def read(path: Path) -> tuple[int, Records]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 0, {}
        return int(data["version"]), {k: AdapterRecord.from_dict(v) for k, v in data["records"].items()}

    @staticmethod
    def write(path: Path, version: int, records: Records) -> None:
        """The whole state, replacing the file at once (readers see the old or the new)."""
        data = {"version": version, "records": {k: json.loads(r.to_json()) for k, r in records.items()}}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def write_if_newer(cls, path: Path, version: int, records: Records) -> None:
        """`write`, unless the file already holds a later version (gateways racing to mirror)."""
        with _file_lock(path.with_name(path.name + ".lock")):
            try:
                current = cls.read(path)[0]
            except (ValueError, KeyError, TypeError):  # a damaged copy: this one replaces it
                current = -1
            if current < version:
                cls.write(path, version, records)

    def _read(self) -> tuple[int, Records]:
        return self.read(self.path)

    def _locked(self, fn: Callable[[], Any]) -> Any:
        with _file_lock(self.lock_path):
            return fn()

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
            self.write(self.path, version + 1, _applied(records, changes))
            return version + 1, result

        return await asyncio.to_thread(self._locked, apply)


def _decode(raw: dict) -> Records:
    out = {}
    for key, value in raw.items():
        key = key.decode() if isinstance(key, bytes) else key
        out[key] = AdapterRecord.from_json(value)
    return out
