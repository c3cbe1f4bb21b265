"""The registry's records and where they are kept (torch-free). The same stores keep the run-time
tenants and keys (gateway/tenancy/accounts.py), under their own `name` and record type.

A record is one tenant's name for one adapter content (its fingerprint) and where it is
placed. Every change is one transaction over the whole set, so a quota is checked
against what is there and a replace moves a name atomically. Each change bumps a version
number: gateway replicas poll it to see changes, and workers ignore a pin set older than
the one they hold.

Kept in the state store's Redis (gateway/state.py: it never evicts and persists; a hash of
records and a version counter, under the deployment's key prefix), shared by every gateway
replica. Without Redis, a JSON file beside the adapter files is the registry, changed under a
file lock (one machine). Nothing writes an older state back: a store that lost its records
starts again from none (a revoked key stays revoked: it is gone), never from a copy.

Versions only go forward and name one state each, across a store that starts again or loses a
commit in a failover too: a commit's version is the wall clock in microseconds, or one more than
the version there when that is later, so a change made after a store lost commits (or was put
back from a copy) gets a version above every one a gateway or worker has seen, and is read by
all of them (they ignore a version older than the one they hold). A store put back from a copy
holds what the copy held: revocations made since must be made again.

A change is optimistic: read the version and the records, compute the change, then one
script applies it only if the version is still the one read (else: again, on what is
there now). The commit is followed, on the same connection, by WAIT for one replica's
acknowledgement, so a change that was answered survives a failover of the master. On a
Redis Cluster the keys carry one hash tag: records, version and leases share a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

from cache.l2 import client_errors, is_cluster

log = logging.getLogger(__name__)
SHARED = ""  # the owner of adapters every tenant allowed "*" may use (the operator's, and the config's)
PENDING = "pending:"  # key prefix of a staged change

Records = dict[str, "AdapterRecord"]
# records -> (key -> new record or None to delete, result)
Change = Callable[[Records], tuple[dict[str, "AdapterRecord | None"], Any]]


class RegistryUnavailable(RuntimeError):
    """The registry's store (Redis) cannot be reached: changes are refused, serving goes on."""


class ReplicaDidNotAcknowledge(RegistryUnavailable):
    """A change is on Redis' master, but none of its replicas acknowledged it in time: a failover now
    could lose it. It stands unless that happens; the caller is told to try again (a register is a
    replace, so doing it again is harmless)."""


UNAVAILABLE_BACKOFF_S = 5.0  # a store found unreachable is not asked again for this long


class SharedReads:
    """A request's path waiting for a store to be read no earlier than it needs: requests that wait
    together share one read, one that comes while a read runs waits for the next, and a store that
    is unreachable (RegistryUnavailable) is not asked again before UNAVAILABLE_BACKOFF_S (requests
    do not each wait on it). `read` reads the store; `clock` is the caller's."""

    def __init__(self, read: Callable[[], Awaitable[object]], clock: Callable[[], float], read_s: float = 0.0) -> None:
        self._read, self._clock = read, clock
        self.read_s = read_s  # when the last finished read began (or when the store may be asked again)
        self.has_failed = False  # the last read found the store unreachable
        self._reading: asyncio.Future | None = None

    async def since(self, after_s: float) -> None:
        """Once a read that began at `after_s` or later has finished (at most two reads' wait)."""
        while self.read_s < after_s:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(self._read_once())
            await asyncio.shield(self._reading)

    async def _read_once(self) -> None:
        began_s = self._clock()
        try:
            await self._read()
            self.has_failed = False
        except RegistryUnavailable as e:
            log.warning("%s; serving what was read last", e)
            self.has_failed = True
            began_s += UNAVAILABLE_BACKOFF_S
        finally:
            self.read_s = max(self.read_s, began_s)


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
    is_dora: bool = False
    chat_template: str | None = None  # the adapter's own (adapter.chat_template)

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
        names = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in names}  # a field a newer gateway wrote is ignored (rolling upgrades)
        data["targets"] = tuple(data.get("targets") or ())
        data["shards"] = tuple(data.get("shards") or ())
        if data.get("invocation_tokens") is not None:
            data["invocation_tokens"] = tuple(data["invocation_tokens"])
        return cls(**data)


def _unavailable(e: Exception, what: str = "the adapter registry") -> RegistryUnavailable:
    return RegistryUnavailable(f"{what} (Redis) is unavailable: {type(e).__name__}")


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


# The scripts' KEYS: the records hash, the version counter (one slot on a cluster).
# -> {version or nil, {field, record JSON, ...}}: one consistent state.
_READ = """
return {redis.call('GET', KEYS[2]) or false, redis.call('HGETALL', KEYS[1])}
"""
# ARGV: the version the change was computed on ('' when there was none), the wall clock in microseconds,
# then (field, record JSON, or '' to delete) pairs. Applied only if the version is still the one read; the
# new version is the clock, or one more than the old when that is later.
# -> the new version, or nil when another gateway committed first.
_COMMIT = """
local current = redis.call('GET', KEYS[2])
if (current or '') ~= ARGV[1] then return false end
for i = 3, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
local version = math.max(tonumber(current or '0') + 1, tonumber(ARGV[2]))
redis.call('SET', KEYS[2], string.format('%d', version))
return version
"""
MAX_REDIRECTS = 3  # a commit sent to a node that no longer owns the slot (failover, resharding): tries on the new owner


def redis_record_keys(key_prefix: str, *, is_cluster: bool, name: str = "registry") -> tuple[str, str]:
    """(records hash, version counter). On one Redis the names they always had (a registry written
    before is read as it is); on a Redis Cluster their common part is a hash tag, so they (and the
    leases, named after the version) share one slot, which the scripts need."""
    common = f"{{{key_prefix}{name}}}" if is_cluster else f"{key_prefix}{name}"
    return f"{common}:records", f"{common}:version"


class RedisRecords:
    """`client` is redis.asyncio's client of one Redis or of a Redis Cluster. A commit waits up to
    `ack_timeout_s` for a replica's acknowledgement; without replicas (one plain Redis) it does not wait.
    (Redis may answer a WAIT that timed out up to 1/hz = 100 ms late: past the client's socket timeout,
    that is a timeout, which answers as a missing acknowledgement does: unavailable.)"""

    def __init__(self, client, key_prefix: str, ack_timeout_s: float = 0.1, name: str = "registry",
                 record_type: Any = None, wall_clock: Callable[[], float] = time.time) -> None:
        if ack_timeout_s <= 0:
            raise ValueError(f"ack_timeout_s must be > 0 (WAIT 0 would wait for ever), got {ack_timeout_s}")
        self.client = client
        self.is_cluster = is_cluster(client)
        self.records_key, self.version_key = redis_record_keys(key_prefix, is_cluster=self.is_cluster, name=name)
        self.record_type = record_type or AdapterRecord  # its from_json and from_dict read what is stored
        self.what = "the adapter registry" if name == "registry" else f"the {name} records"  # in errors
        self.ack_timeout_ms = max(1, round(ack_timeout_s * 1000))
        self._wall_clock = wall_clock
        self._read_script = client.register_script(_READ)

    async def version(self) -> int:
        try:
            raw = await self.client.get(self.version_key)
        except client_errors() as e:
            raise _unavailable(e, self.what) from e
        return int(raw) if raw is not None else 0

    async def load(self) -> tuple[int, Records]:
        try:
            version, records = await self._read()
        except client_errors() as e:
            raise _unavailable(e, self.what) from e
        return int(version or 0), records

    async def _read(self) -> tuple[bytes | None, Records]:
        """The version as stored (None: no registry) and the records, read together."""
        version, flat = await self._read_script(keys=[self.records_key, self.version_key])
        return version, _decode(dict(zip(flat[::2], flat[1::2])), self.record_type)

    async def lease(self, name: str, ttl_s: float) -> bool:
        try:
            lease_ms = max(1, int(ttl_s * 1000))
            return bool(await self.client.set(f"{self.version_key}:lease:{name}", b"1", nx=True, px=lease_ms))
        except client_errors() as e:
            raise _unavailable(e, self.what) from e

    async def transact(self, change: Change) -> tuple[int, Any]:
        try:
            while True:
                read_version, records = await self._read()
                changes, result = change(records)  # a refusal from `change` itself goes to the caller as it is
                version, num_replicas, num_acks = await self._commit(read_version, changes)
                if version is not None:
                    break  # else another gateway changed it meanwhile: again, on what is there now
        except client_errors() as e:
            raise _unavailable(e, self.what) from e
        if num_replicas and not num_acks:
            raise ReplicaDidNotAcknowledge(
                f"{self.what}'s change (version {version}) is on Redis' master, but none of its {num_replicas} "
                f"replica(s) acknowledged it within {self.ack_timeout_ms} ms: a failover now could lose it")
        return version, result

    async def _commit(self, read_version: bytes | None, changes: dict[str, AdapterRecord | None]) -> tuple[int | None, int, int]:
        """(the new version, or None if another change came first; replicas the master has; how many of them
        acknowledged the change). WAIT goes right after the script on the same connection (it waits for that
        connection's last write), and only to a master with replicas: without any, it would wait its whole timeout."""
        from redis.exceptions import AskError, TryAgainError

        clock_us = int(self._wall_clock() * 1_000_000)  # a version above any an earlier state of the store reached
        args = [read_version or b"", clock_us] + [x for key, r in changes.items() for x in (key, "" if r is None else r.to_json())]
        for _ in range(MAX_REDIRECTS):
            num_replicas = await replicas_of_master(self.client, self.version_key)
            commit = ("EVAL", _COMMIT, 2, self.records_key, self.version_key, *args)
            replies = await on_master(self.client, self.version_key,
                                      [commit, ("WAIT", 1, self.ack_timeout_ms)] if num_replicas else [commit])
            if not isinstance(replies[0], (AskError, TryAgainError)):  # MovedError is an AskError
                break
            await self.client.exists(self.version_key)  # through the client, which follows the redirect and learns the new owner
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        version = int(replies[0]) if replies[0] is not None else None
        return version, num_replicas, int(replies[1]) if num_replicas else 0

async def replicas_of_master(client, key: str) -> int:
    """How many replicas the master of `key`'s slot has (0 when the node asked is itself a replica: a stale
    slot map, which a script sent there answers with MOVED)."""
    (role,) = await on_master(client, key, [("ROLE",)])
    if isinstance(role, Exception):
        raise role
    return len(role[2]) if role[0] == b"master" else 0


async def on_master(client, key: str, commands: list[tuple]) -> list[Any]:
    """`commands` in order on one connection to the master of `key`'s slot (one Redis: that server);
    each reply or its error. One connection, so a WAIT after a write waits for that write."""
    if not is_cluster(client):
        async with client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=False)
    await client.initialize()  # the slot map (a no-op once known)
    node = client.get_node_from_key(key)
    pipe = client.pipeline()
    for command in commands:
        pipe.execute_command(*command, target_nodes=node)
    return await pipe.execute(raise_on_error=False, allow_redirections=False)


class FileRecords:
    """One JSON file, changed under an exclusive lock (every process on this machine)."""

    def __init__(self, directory: Path, scope: str = "", name: str = "registry", record_type: Any = None) -> None:
        name = f"{name}-{scope}" if scope else name
        self.path, self.lock_path = directory / f"{name}.json", directory / f"{name}.lock"
        self.record_type = record_type or AdapterRecord

    @staticmethod
    def read(path: Path, record_type: Any = None) -> tuple[int, Records]:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return 0, {}
        from_dict = (record_type or AdapterRecord).from_dict
        return int(data["version"]), {k: from_dict(v) for k, v in data["records"].items()}

    @staticmethod
    def write(path: Path, version: int, records: Records) -> None:
        """The whole state, replacing the file at once (readers see the old or the new)."""
        data = {"version": version, "records": {k: json.loads(r.to_json()) for k, r in records.items()}}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)

    def _read(self) -> tuple[int, Records]:
        return self.read(self.path, self.record_type)

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


def _decode(raw: dict, record_type: Any) -> Records:
    out = {}
    for key, value in raw.items():
        key = key.decode() if isinstance(key, bytes) else key
        out[key] = record_type.from_json(value)
    return out
