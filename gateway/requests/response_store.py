"""Stored responses of the Responses API (torch-free): a response and the conversation that led to
it, kept per tenant so `GET /v1/responses/{id}` can return it and `previous_response_id` can go on
from it.

Bounded and expiring: a record (the response and its input items, as JSON) holds at most
`MAX_RECORD_BYTES`; a tenant keeps at most `MAX_RESPONSES_PER_TENANT`, its oldest dropped first;
each expires `RESPONSE_TTL_S` after it was stored. A tenant reads only its own records: another's
id is simply not among its keys, so it answers as an unknown id does.

Kept in Redis when the deployment has one (so every gateway replica sees them), under the
deployment's key prefix, with the tenant's id as a hash tag (a tenant's keys share one slot of a
Redis Cluster):

    {prefix}:responses:{<tenant>}:<response id>   the record, with its TTL
    {prefix}:responses:{<tenant>}:index           the tenant's response ids, scored by when stored

Without Redis they are kept in the process (one gateway replica), within the same bounds. Redis
failing is `StoreUnavailable`: the routes answer a read that needs it with 503, and log a write
that failed (the answer, already generated, still goes out; that id is then unknown).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cache.l2 import client_errors, connect
from gateway.config import ServeConfig

RESPONSE_TTL_S = 24 * 3600
MAX_RESPONSES_PER_TENANT = 1000
MAX_RECORD_BYTES = 1 << 20


class StoreUnavailable(Exception):
    """The store (Redis) cannot be reached."""


class RecordTooLarge(ValueError):
    """A record over MAX_RECORD_BYTES: not stored."""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object, as it was answered
    input_items: list[dict[str, Any]]  # every item before its output: the earlier responses' and its own input

    @property
    def id(self) -> str:
        return self.response["id"]

    def conversation(self) -> list[dict[str, Any]]:
        """What a request that continues from this response goes on from."""
        return self.input_items + self.response["output"]

    def to_json(self) -> bytes:
        return json.dumps({"response": self.response, "input_items": self.input_items},
                          ensure_ascii=False).encode()

    @classmethod
    def from_json(cls, data: bytes) -> StoredResponse:
        record = json.loads(data)
        return cls(record["response"], record["input_items"])


def _checked(record: StoredResponse, max_bytes: int) -> bytes:
    data = record.to_json()
    if len(data) > max_bytes:
        raise RecordTooLarge(f"response {record.id} is {len(data)} bytes stored, over {max_bytes}")
    return data


class LocalResponses:
    """The records of one process, per tenant in the order they were stored."""

    def __init__(self, ttl_s: float = RESPONSE_TTL_S, max_per_tenant: int = MAX_RESPONSES_PER_TENANT,
                 max_record_bytes: int = MAX_RECORD_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s, self.max_per_tenant, self.max_record_bytes, self._clock = ttl_s, max_per_tenant, max_record_bytes, clock
        self._by_tenant: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}  # id -> (expires at, record)

    def _records(self, tenant_id: str) -> OrderedDict[str, tuple[float, bytes]]:
        records = self._by_tenant.setdefault(tenant_id, OrderedDict())
        now_s = self._clock()
        while records and next(iter(records.values()))[0] <= now_s:  # the oldest expire first
            records.popitem(last=False)
        return records

    async def put(self, tenant_id: str, record: StoredResponse) -> None:
        data = _checked(record, self.max_record_bytes)
        records = self._records(tenant_id)
        records[record.id] = (self._clock() + self.ttl_s, data)
        while len(records) > self.max_per_tenant:
            records.popitem(last=False)

    async def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        entry = self._records(tenant_id).get(response_id)
        return StoredResponse.from_json(entry[1]) if entry is not None else None

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        return self._records(tenant_id).pop(response_id, None) is not None


class RedisResponses:
    """The records in Redis; `client` is redis.asyncio's (one Redis, or a Redis Cluster's)."""

    def __init__(self, client: Any, key_prefix: str, ttl_s: int = RESPONSE_TTL_S,
                 max_per_tenant: int = MAX_RESPONSES_PER_TENANT, max_record_bytes: int = MAX_RECORD_BYTES,
                 clock: Callable[[], float] = time.time) -> None:
        self.client, self.key_prefix = client, key_prefix
        self.ttl_s, self.max_per_tenant, self.max_record_bytes, self._clock = ttl_s, max_per_tenant, max_record_bytes, clock

    def _key(self, tenant_id: str, name: str) -> str:
        return f"{self.key_prefix}:responses:{{{tenant_id}}}:{name}"

    async def put(self, tenant_id: str, record: StoredResponse) -> None:
        """Store it, then drop what is past the tenant's bound (expired ids leave the index too)."""
        data = _checked(record, self.max_record_bytes)
        index, now_s = self._key(tenant_id, "index"), self._clock()
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self._key(tenant_id, record.id), data, ex=self.ttl_s)
            pipe.zadd(index, {record.id: now_s})
            pipe.zremrangebyscore(index, "-inf", now_s - self.ttl_s)
            pipe.expire(index, self.ttl_s)
            pipe.zcard(index)
            *_, num_stored = await pipe.execute()
            if num_stored > self.max_per_tenant:
                oldest = await self.client.zrange(index, 0, num_stored - self.max_per_tenant - 1)
                pipe = self.client.pipeline(transaction=False)
                pipe.delete(*(self._key(tenant_id, i.decode()) for i in oldest))
                pipe.zrem(index, *oldest)
                await pipe.execute()
        except client_errors() as e:
            raise StoreUnavailable(f"stored responses: Redis unavailable ({type(e).__name__})") from e

    async def get(self, tenant_id: str, response_id: str) -> StoredResponse | None:
        try:
            data = await self.client.get(self._key(tenant_id, response_id))
        except client_errors() as e:
            raise StoreUnavailable(f"stored responses: Redis unavailable ({type(e).__name__})") from e
        return StoredResponse.from_json(data) if data is not None else None

    async def delete(self, tenant_id: str, response_id: str) -> bool:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.delete(self._key(tenant_id, response_id))
            pipe.zrem(self._key(tenant_id, "index"), response_id)
            num_deleted, _ = await pipe.execute()
        except client_errors() as e:
            raise StoreUnavailable(f"stored responses: Redis unavailable ({type(e).__name__})") from e
        return num_deleted > 0


ResponseStore = LocalResponses | RedisResponses


def open_response_store(config: ServeConfig) -> ResponseStore:
    """The deployment's store: in its state store's Redis when it has one, else in this process."""
    redis_config = config.state_redis()
    if redis_config is None:
        return LocalResponses()
    return RedisResponses(connect(redis_config, is_async=True), redis_config.key_prefix)
