"""Who is calling, and what they may use (torch-free).

Tenants come from the config file (the bootstrap: fixed while the deployment runs) and from the
run-time records the operator manages (gateway/accounts.py: in Redis, shared by every gateway
replica). A key maps to its tenant through its SHA-256 digest; a revoked or expired key, or one of
a disabled tenant, is refused. Each gateway reads the records again when its last look is older
than `ACCOUNTS_POLL_S` (the request that finds it so waits for the read): a change made through
any gateway replica, a revoked key included, holds on every replica within that bound (plus one
Redis round trip). Redis being down keeps the last state read (each request does not wait on it).

A tenant sees only the adapters its policy allows, and an adapter it may not use answers exactly
as an unknown one. Each tenant's prefix cache is its own (salt = tenant id) unless it opts into
the shared salt; a request's `cache_salt` narrows that further, never widens it.

Keys are looked up by their digest in a dict: a timing difference could tell an attacker
something of a SHA-256 digest, not of a key.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gateway.accounts import AccountRecords, Accounts, KeyRecord, Snapshot, TenantRecord
from gateway.api.protocol import APIError
from gateway.config import ServeConfig, TenantConfig
from gateway.registry.records import FileRecords, RecordStore, RedisRecords, SharedReads
from worker.contract.identity import AdapterName

ANONYMOUS = "anonymous"
SHARED_SALT = "shared"
ACCOUNTS_POLL_S = 0.5  # the bound on how stale a gateway's view of tenants and keys may be


@dataclass
class Tenant:
    id: str
    allowed: frozenset[AdapterName] | None  # None: every adapter
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    shared_cache: bool = False
    max_adapters: int = 32  # adapters it may register at run time, and their total bytes
    max_adapter_bytes: int = 1 << 30
    default_scales: dict[AdapterName, float] = field(default_factory=dict)  # set by POST /lora-adapters
    tokens_per_day: int | None = None  # quotas (gateway/usage.py), per UTC day and month
    tokens_per_month: int | None = None
    key_id: str = ""  # the key this request came with (usage is counted per key)
    is_runtime: bool = False  # made through the API (gateway/accounts.py), not the config file

    def may_use(self, name: AdapterName) -> bool:
        return self.allowed is None or name in self.allowed

    def cache_salt(self, request_salt: str | None) -> str:
        base = SHARED_SALT if self.shared_cache else f"tenant:{self.id}"
        return base if not request_salt else f"{base}/{request_salt}"

    @classmethod
    def from_config(cls, t: TenantConfig) -> Tenant:
        allowed = None if t.adapters == "*" else frozenset(AdapterName(n) for n in t.adapters)
        return cls(t.id, allowed, t.requests_per_min, t.tokens_per_min, t.shared_cache, t.max_adapters,
                   t.max_adapter_bytes, tokens_per_day=t.tokens_per_day, tokens_per_month=t.tokens_per_month)

    @classmethod
    def from_record(cls, r: TenantRecord, default_scales: dict[AdapterName, float]) -> Tenant:
        allowed = None if r.adapters is None else frozenset(AdapterName(n) for n in r.adapters)
        return cls(r.id, allowed, r.requests_per_min, r.tokens_per_min, r.shared_cache, r.max_adapters, r.max_adapter_bytes,
                   default_scales, r.tokens_per_day, r.tokens_per_month, is_runtime=True)


def config_key_id(sha256_hex: str) -> str:
    """The id of a key the config file names by its digest."""
    return f"cfg-{sha256_hex[:12]}"


class Tenants:
    def __init__(self, config: ServeConfig, records: RecordStore | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time) -> None:
        self.configured = {t.id: Tenant.from_config(t) for t in config.tenants}
        self._config_keys = {d: t.id for t in config.tenants for d in t.key_sha256}  # digest -> tenant id
        self._operator_digests = [bytes.fromhex(d) for d in config.operator_key_sha256]
        self.accounts = None if records is None else Accounts(records, frozenset(self.configured), frozenset(self._config_keys),
                                                              wall_clock)
        self._clock, self._wall_clock = clock, wall_clock
        self.snapshot = Snapshot()
        self._scales: dict[str, dict[AdapterName, float]] = {}  # each run-time tenant's default scales, kept across reads
        self._runtime: dict[str, Tenant] = {}
        self._reads = SharedReads(self.refresh, clock, read_s=float("-inf"))
        # run-time tenants are made with an operator key: without one configured there are none to wait for
        self._has_read = records is None or not self._operator_digests
        self.anonymous = Tenant(ANONYMOUS, None)

    @property
    def by_id(self) -> dict[str, Tenant]:
        """Every tenant: the config's and the run-time ones (a disabled one too), or the anonymous one."""
        if self.is_open:
            return {ANONYMOUS: self.anonymous}
        return {**self._runtime, **self.configured}

    @property
    def is_open(self) -> bool:
        """No tenant anywhere, and none ever made at run time (deleting the last one does not open it):
        no auth, one anonymous tenant (a local deployment)."""
        return not self.configured and not self.snapshot.has_had_tenants and self._has_read

    # keeping up with the records

    async def refresh_if_stale(self) -> None:
        """A request's path: the records read again when the last read began over ACCOUNTS_POLL_S
        before it arrived (SharedReads: requests that come together share one read)."""
        if self.accounts is not None:
            await self._reads.since(self._clock() - ACCOUNTS_POLL_S)

    async def refresh(self) -> None:
        assert self.accounts is not None
        version = await self.accounts.records.version()
        if version != self.snapshot.version:
            version, records = await self.accounts.load()
            self.apply(Snapshot.of(version, records))
        self._has_read = True

    def apply(self, snapshot: Snapshot) -> None:
        """Take a newer read of the records (a change this gateway made is applied at once)."""
        if snapshot.version < self.snapshot.version:
            return
        self.snapshot = snapshot
        self._runtime = {r.id: Tenant.from_record(r, self._scales.setdefault(r.id, {}))
                         for r in snapshot.tenants.values() if r.id not in self.configured}

    # who is calling

    def authenticate(self, authorization: str | None) -> Tenant:
        """The calling tenant, as seen by this key (its `key_id` set); 401 for no key or a bad,
        revoked or expired one, 403 for a disabled tenant's, 503 before the records could be read."""
        if self.is_open:
            return self.anonymous
        sha256 = _key_digest(authorization).hex()
        tenant_id = self._config_keys.get(sha256)
        if tenant_id is not None:
            return replace(self.configured[tenant_id], key_id=config_key_id(sha256))
        key: KeyRecord | None = self.snapshot.keys_by_digest.get(sha256)
        if key is None and not self._has_read:  # it may be a run-time key, not read yet
            raise APIError(503, "API keys cannot be read yet (the deployment's Redis is unreachable)", "tenants_unavailable",
                           {"Retry-After": "5"})
        if key is None or key.tenant not in self._runtime:
            raise APIError(401, "invalid API key", "invalid_api_key")
        if key.revoked_s is not None:
            raise APIError(401, "this API key has been revoked", "invalid_api_key")
        if not key.is_valid(self._wall_clock()):
            raise APIError(401, "this API key has expired", "expired_api_key")
        if self.snapshot.tenants[key.tenant].is_disabled:
            raise APIError(403, "this tenant is disabled", "tenant_disabled")
        return replace(self._runtime[key.tenant], key_id=key.id)

    @property
    def is_operator_open(self) -> bool:
        """Neither tenants nor operator keys configured: a local, unauthenticated deployment."""
        return not self.configured and not self._operator_digests

    def is_operator(self, authorization: str | None) -> bool:
        """The caller holds an operator key (never true without one configured)."""
        if not self._operator_digests or not authorization:
            return False
        try:
            return _match(_key_digest(authorization), self._operator_digests)
        except APIError:
            return False

    def authenticate_operator(self, authorization: str | None) -> None:
        """401/403 unless the caller holds an operator key (or is_operator_open)."""
        if self.is_operator_open:
            return
        if not self._operator_digests:
            raise APIError(403, "this endpoint needs an operator key, and none is configured (operator_key_sha256)",
                           "operator_only")
        if not _match(_key_digest(authorization), self._operator_digests):
            raise APIError(401, "invalid operator key", "invalid_api_key")


def _key_digest(authorization: str | None) -> bytes:
    if not authorization:
        raise APIError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", "missing_api_key")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "malformed Authorization header: expected 'Bearer YOUR_KEY'", "invalid_api_key")
    return hashlib.sha256(key.strip().encode()).digest()


def _match(digest: bytes, known: list[bytes]) -> bool:
    """Whether `digest` is one of `known`; every one is compared, in constant time."""
    found = False
    for candidate in known:
        found = hmac.compare_digest(candidate, digest) or found
    return found


def open_tenants(config: ServeConfig, clock: Callable[[], float] = time.monotonic) -> Tenants:
    """The deployment's tenants: the config's, and the run-time ones kept in its Redis (a mirror of
    them beside the adapter files), or in a file there without Redis."""
    directory = Path(config.blob_store().cache_dir).expanduser()
    redis_config = config.cache.redis
    if redis_config is not None:
        from cache.l2 import connect

        records: RecordStore = RedisRecords(connect(redis_config, is_async=True), f"{redis_config.key_prefix}:",
                                            mirror=directory / "tenants.redis-mirror.json",
                                            ack_timeout_s=redis_config.replica_ack_timeout_s, name="tenants",
                                            record_type=AccountRecords)
    else:
        records = FileRecords(directory, name="tenants", record_type=AccountRecords)
    return Tenants(config, records, clock)
