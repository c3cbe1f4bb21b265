"""Tenants and API keys made at run time (torch-free): their records, and the changes the
operator makes to them (create, update, disable, delete a tenant; issue, rotate, revoke a key).

They are kept as the adapter registry's are (gateway/registry/records.py): one versioned set of
records in the state store (gateway/state.py), every change one optimistic transaction that is
acknowledged only once a Redis replica holds it (WAIT), and a file under a lock when there is no
Redis (one machine). Tenants, their keys and operator keys (gateway/tenancy/operators.py) share one set,
so deleting a tenant takes its keys in the same transaction.

A key is kept as gateway/tenancy/keys.py keeps every key: shown once, its digest stored with an id (what
usage, listings and revocation name it by), its first characters, an optional name and expiry.
Tenants from the config file are the bootstrap: they cannot be changed here (ConfigTenant), and no
run-time tenant may take their ids.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from gateway.registry.records import Records, RecordStore, ReplicaDidNotAcknowledge
from gateway.tenancy.keys import AccountError, StoredKey, checked_request, digest, forgotten, known_fields, new_key_changes, revoked
from gateway.tenancy.operators import OperatorKeyRecord, operator_keys_of

KEY_PREFIX = "sk-lp-"  # an issued key: this, then 43 URL-safe characters (32 random bytes)
SHOWN_CHARS = len(KEY_PREFIX) + 4  # how much of a key listings show
TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MAX_KEYS_PER_TENANT = 64
MAX_ADAPTER_PATHS = 64  # a tenant's adapter_paths, each an absolute directory of at most MAX_PATH_CHARS
MAX_PATH_CHARS = 4096
RESERVED_IDS = frozenset({"anonymous"})  # the open deployment's tenant (gateway/tenancy/tenants.py)


@dataclass(frozen=True)
class TenantRecord:
    id: str
    adapters: tuple[str, ...] | None = None  # the adapters it may use; None: every one
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    tokens_per_day: int | None = None  # quotas on prompt + generated tokens, per UTC day and month
    tokens_per_month: int | None = None
    shared_cache: bool = False
    max_adapters: int = 32
    max_adapter_bytes: int = 1 << 30
    adapter_paths: tuple[str, ...] = ()  # absolute directories its keys may load adapters from by server path
    is_disabled: bool = False  # its keys are refused (403) until it is enabled again
    is_deleted: bool = False  # a tombstone: the id is never used again (its usage, responses and cache salt stay its own)
    created_s: float = 0.0
    updated_s: float = 0.0
    kind: str = "tenant"

    @property
    def key(self) -> str:
        return f"tenant/{self.id}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TenantRecord:
        data = known_fields(cls, data)
        if data.get("adapters") is not None:
            data["adapters"] = tuple(data["adapters"])
        data["adapter_paths"] = tuple(data.get("adapter_paths", ()))
        return cls(**data)

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        del out["kind"], out["is_deleted"]
        out["adapters"] = "*" if self.adapters is None else list(self.adapters)
        out["adapter_paths"] = list(self.adapter_paths)
        return out


@dataclass(frozen=True)
class KeyRecord(StoredKey):
    id: str
    tenant: str
    sha256: str  # hex digest of the key
    shown: str  # its first characters
    name: str = ""
    created_s: float = 0.0
    expires_s: float | None = None  # wall-clock time; None: never
    revoked_s: float | None = None
    kind: str = "key"

    @property
    def key(self) -> str:
        return f"key/{self.id}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeyRecord:
        return cls(**known_fields(cls, data))


class AccountRecords:
    """The record type of the store: a tenant, a key or an operator key, by its `kind`."""

    @staticmethod
    def from_dict(data: dict[str, Any]) -> TenantRecord | KeyRecord | OperatorKeyRecord:
        kind = data.get("kind")
        if kind == "operator_key":
            return OperatorKeyRecord.from_dict(data)
        return KeyRecord.from_dict(data) if kind == "key" else TenantRecord.from_dict(data)

    @staticmethod
    def from_json(text: str | bytes) -> TenantRecord | KeyRecord | OperatorKeyRecord:
        return AccountRecords.from_dict(json.loads(text))


def tenants_of(records: Records) -> dict[str, TenantRecord]:
    """The live tenants (not the tombstones of deleted ones)."""
    return {r.id: r for r in records.values() if isinstance(r, TenantRecord) and not r.is_deleted}


def keys_of(records: Records, tenant: str | None = None) -> list[KeyRecord]:
    keys = (r for r in records.values() if isinstance(r, KeyRecord) and tenant in (None, r.tenant))
    return sorted(keys, key=lambda k: (k.created_s, k.id))


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


TENANT_FIELDS = {  # what the operator may set, and its check
    "adapters": lambda v: v == "*" or (isinstance(v, list) and len(v) <= 10_000
                                       and all(isinstance(n, str) and 0 < len(n) <= 256 for n in v)),
    "requests_per_min": lambda v: v is None or (_is_int(v) and 1 <= v <= 10**9),
    "tokens_per_min": lambda v: v is None or (_is_int(v) and 1 <= v <= 10**12),
    "tokens_per_day": lambda v: v is None or (_is_int(v) and 1 <= v <= 10**15),
    "tokens_per_month": lambda v: v is None or (_is_int(v) and 1 <= v <= 10**15),
    "shared_cache": lambda v: isinstance(v, bool),
    "max_adapters": lambda v: _is_int(v) and 0 <= v <= 100_000,
    "max_adapter_bytes": lambda v: _is_int(v) and 0 <= v <= 1 << 50,
    "adapter_paths": lambda v: isinstance(v, list) and len(v) <= MAX_ADAPTER_PATHS and all(_is_absolute_path(p) for p in v),
    "disabled": lambda v: isinstance(v, bool),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_absolute_path(v: Any) -> bool:
    return isinstance(v, str) and os.path.isabs(v) and len(v) <= MAX_PATH_CHARS and "\0" not in v


def checked_fields(body: Any) -> dict[str, Any]:
    """A tenant body's settings, each checked (AccountError 400 naming the first bad one)."""
    if not isinstance(body, dict):
        raise AccountError(400, "expected a JSON object", "invalid_value")
    unknown = sorted(set(body) - set(TENANT_FIELDS) - {"id"})
    if unknown:
        raise AccountError(400, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(TENANT_FIELDS))})", "invalid_value")
    for name, value in body.items():
        if name != "id" and not TENANT_FIELDS[name](value):
            raise AccountError(400, f"{name}: {value!r} is not a valid value", "invalid_value")
    out = {k: v for k, v in body.items() if k != "id"}
    if "adapters" in out:
        out["adapters"] = None if out["adapters"] == "*" else tuple(out["adapters"])
    if "adapter_paths" in out:
        out["adapter_paths"] = tuple(out["adapter_paths"])
    if "disabled" in out:
        out["is_disabled"] = out.pop("disabled")
    return out


class Accounts:
    """The operator's changes to run-time tenants and keys, over a RecordStore. `reserved`: the
    config file's tenant ids (and their key digests), which run-time records may not take."""

    def __init__(self, records: RecordStore, reserved_ids: frozenset[str], reserved_digests: frozenset[str],
                 clock: Callable[[], float] = time.time) -> None:
        self.records, self.reserved_ids, self.reserved_digests, self.clock = records, reserved_ids, reserved_digests, clock

    def _config_tenant(self, tenant_id: str) -> None:
        if tenant_id in self.reserved_ids:
            raise AccountError(409, f"tenant {tenant_id!r} is defined in the deployment config; change it there",
                               "config_tenant")

    @staticmethod
    def _tenant(records: Records, tenant_id: str) -> TenantRecord:
        found = records.get(f"tenant/{tenant_id}")
        if not isinstance(found, TenantRecord) or found.is_deleted:
            raise AccountError(404, f"tenant {tenant_id!r} not found", "tenant_not_found")
        return found

    async def create_tenant(self, tenant_id: str, settings: dict[str, Any]) -> TenantRecord:
        if not isinstance(tenant_id, str) or not TENANT_ID.fullmatch(tenant_id):
            raise AccountError(400, "id: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit", "invalid_value")
        if tenant_id in RESERVED_IDS:
            raise AccountError(409, f"tenant id {tenant_id!r} is reserved", "tenant_exists")
        self._config_tenant(tenant_id)
        now_s = self.clock()
        record = replace(TenantRecord(tenant_id, created_s=now_s, updated_s=now_s), **settings)

        def create(records: Records):
            old = records.get(record.key)
            if isinstance(old, TenantRecord) and old.is_deleted:
                raise AccountError(409, f"tenant id {tenant_id!r} belonged to a deleted tenant: ids are never used again "
                                   "(its usage, stored responses and cache stay its own)", "tenant_exists")
            if old is not None:
                raise AccountError(409, f"tenant {tenant_id!r} exists", "tenant_exists")
            return {record.key: record}, record

        return (await self.records.transact(create))[1]

    async def update_tenant(self, tenant_id: str, settings: dict[str, Any]) -> TenantRecord:
        self._config_tenant(tenant_id)

        def update(records: Records):
            record = replace(self._tenant(records, tenant_id), **settings, updated_s=self.clock())
            return {record.key: record}, record

        return (await self.records.transact(update))[1]

    async def delete_tenant(self, tenant_id: str) -> TenantRecord:
        """The tenant and every key it has, in one change; a tombstone keeps its id from being used again."""
        self._config_tenant(tenant_id)

        def delete(records: Records):
            record = self._tenant(records, tenant_id)
            tombstone = TenantRecord(tenant_id, is_deleted=True, created_s=record.created_s, updated_s=self.clock())
            return {record.key: tombstone, **{k.key: None for k in keys_of(records, tenant_id)}}, record

        return (await self.records.transact(delete))[1]

    async def issue_key(self, tenant_id: str, name: str = "", expires_s: float | None = None,
                        replacing: str | None = None, old_expires_s: float | None = None) -> tuple[str, KeyRecord, str | None]:
        """A new key of `tenant_id`: the key itself, its record, and a warning when no Redis replica
        acknowledged it in time (it is shown anyway: refusing would lose a key that works). With
        `replacing` (rotation): that key expires at `old_expires_s` (now when None) in the same change.
        A tenant has at most MAX_KEYS_PER_TENANT live keys, the old one of a rotation with a grace period
        included (counted once); a rotation that ends the old key now is always allowed."""
        self._config_tenant(tenant_id)
        now_s = self.clock()
        checked_request(name, expires_s, now_s)
        key = new_key()
        record = KeyRecord("key_" + secrets.token_hex(8), tenant_id, digest(key), key[:SHOWN_CHARS], name, now_s, expires_s)

        def issue(records: Records):
            self._tenant(records, tenant_id)
            old = None
            if replacing is not None:
                old = records.get(f"key/{replacing}")
                if not isinstance(old, KeyRecord) or old.tenant != tenant_id:
                    raise AccountError(404, f"key {replacing!r} not found", "key_not_found")
            keys = keys_of(records, tenant_id)
            live = [k for k in keys if k.is_valid(now_s)]
            changes = {**forgotten(keys, now_s),
                       **new_key_changes(old, live, MAX_KEYS_PER_TENANT, now_s, old_expires_s, f"tenant {tenant_id!r}"),
                       record.key: record}
            return changes, record

        try:
            await self.records.transact(issue)
        except ReplicaDidNotAcknowledge as e:  # committed on the master: the key works unless a failover loses it
            return key, record, str(e)
        return key, record, None

    async def revoke_key(self, tenant_id: str, key_id: str) -> KeyRecord:
        self._config_tenant(tenant_id)

        def revoke(records: Records):
            old = records.get(f"key/{key_id}")
            if not isinstance(old, KeyRecord) or old.tenant != tenant_id:
                raise AccountError(404, f"key {key_id!r} not found", "key_not_found")
            record = revoked(old, self.clock())
            return {record.key: record}, record

        return (await self.records.transact(revoke))[1]

    async def load(self) -> tuple[int, Records]:
        return await self.records.load()


@dataclass
class Snapshot:
    """The run-time tenants and keys as one gateway last read them."""

    version: int = -1
    tenants: dict[str, TenantRecord] = field(default_factory=dict)
    keys_by_digest: dict[str, KeyRecord] = field(default_factory=dict)
    operator_keys_by_digest: dict[str, OperatorKeyRecord] = field(default_factory=dict)

    @classmethod
    def of(cls, version: int, records: Records) -> Snapshot:
        return cls(version, tenants_of(records), {k.sha256: k for k in keys_of(records)},
                   {k.sha256: k for k in operator_keys_of(records)})
