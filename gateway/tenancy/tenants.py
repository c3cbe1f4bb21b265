"""Who is calling, and what they may use (torch-free).

Tenants come from the config file (the bootstrap: fixed while the deployment runs) and from the
run-time records the operator manages (gateway/tenancy/accounts.py: in the state store, shared by every
gateway replica). A key maps to its tenant through its SHA-256 digest; a revoked or expired key, or
one of a disabled tenant, is refused. Each gateway reads the records again when its last look is
older than `ACCOUNTS_POLL_S` (the request that finds it so waits for the read): a change made
through any gateway replica, a revoked key included, holds on every replica within that bound
(plus one Redis round trip); a key this gateway does not know yet is looked up at once, so a
key just made works on every replica. While the state store cannot be read, a gateway serves run-time keys
from its last read for at most `state.stale_after_s`, then refuses them (503); the config's keys go
on. A version older than one read is never taken, and every change gets a version above all
earlier ones (gateway/registry/records.py), so a store that lost a commit or was put back from a
copy cannot hold a gateway to an old view for longer than the next change.

Nobody is let in by inference: anonymous access is `auth: none` in the config, whatever a store
holds or fails to hold. Operators hold the config's operator keys (every scope) or operator keys
made at run time with scopes (gateway/tenancy/operators.py SCOPES); a state store refused by its check
(gateway/state.py) refuses every request with the reason.

A tenant sees only the adapters its policy allows, and an adapter it may not use answers exactly
as an unknown one. Each tenant's prefix cache is its own (salt = tenant id) unless it opts into
the shared salt; a request's `cache_salt` narrows that further, never widens it.

Keys are looked up by their digest in a dict: a timing difference could tell an attacker
something of a SHA-256 digest, not of a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from cache.l2 import client_errors
from gateway.config import ServeConfig, TenantConfig
from gateway.errors import GatewayError
from gateway.registry.records import FileRecords, RecordStore, RedisRecords, RegistryUnavailable, SharedReads
from gateway.state import StateStoreRefused, check
from gateway.tenancy.accounts import AccountRecords, Accounts, KeyRecord, Snapshot, TenantRecord
from worker.contract.identity import AdapterName

log = logging.getLogger(__name__)
ANONYMOUS = "anonymous"
OPEN_OPERATOR = "open"  # the operator an open deployment's caller is (auth: none and no operator key)
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
    tokens_per_day: int | None = None  # quotas (gateway/tenancy/usage.py), per UTC day and month
    tokens_per_month: int | None = None
    key_id: str = ""  # the key this request came with (usage is counted per key)
    is_runtime: bool = False  # made through the API (gateway/tenancy/accounts.py), not the config file
    # directories its keys may load adapters from by server path (relative: to the config file), each
    # within registry.allowed_paths (gateway/api/admin/adapters.py)
    adapter_paths: tuple[str, ...] = ()

    def may_use(self, name: AdapterName) -> bool:
        return self.allowed is None or name in self.allowed

    def cache_salt(self, request_salt: str | None) -> str:
        base = SHARED_SALT if self.shared_cache else f"tenant:{self.id}"
        return base if not request_salt else f"{base}/{request_salt}"

    @classmethod
    def from_config(cls, t: TenantConfig) -> Tenant:
        allowed = None if t.adapters == "*" else frozenset(AdapterName(n) for n in t.adapters)
        return cls(t.id, allowed, t.requests_per_min, t.tokens_per_min, t.shared_cache, t.max_adapters,
                   t.max_adapter_bytes, tokens_per_day=t.tokens_per_day, tokens_per_month=t.tokens_per_month,
                   adapter_paths=tuple(t.adapter_paths))

    @classmethod
    def from_record(cls, r: TenantRecord, default_scales: dict[AdapterName, float]) -> Tenant:
        allowed = None if r.adapters is None else frozenset(AdapterName(n) for n in r.adapters)
        return cls(r.id, allowed, r.requests_per_min, r.tokens_per_min, r.shared_cache, r.max_adapters, r.max_adapter_bytes,
                   default_scales, r.tokens_per_day, r.tokens_per_month, is_runtime=True, adapter_paths=r.adapter_paths)


def config_key_id(sha256_hex: str) -> str:
    """The id of a key the config file names by its digest."""
    return f"cfg-{sha256_hex[:12]}"


@dataclass(frozen=True)
class Operator:
    """Who holds an operator key, and what it may do (gateway/tenancy/operators.py SCOPES)."""

    id: str  # the key's id: cfg-... for the config's, opk_... for one made at run time
    scopes: tuple[str, ...]

    def may(self, scope: str) -> bool:
        return "admin" in self.scopes or scope in self.scopes


class Tenants:
    """`stale_after_s`: how long the run-time records last read stay good while the store cannot
    be read again; `verify`: the state store's check (gateway/state.py), run before the first read."""

    def __init__(self, config: ServeConfig, records: RecordStore | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 verify: Callable[[], Awaitable[None]] | None = None) -> None:
        self.configured = {t.id: Tenant.from_config(t) for t in config.tenants}
        self._config_keys = {d: t.id for t in config.tenants for d in t.key_sha256}  # digest -> tenant id
        self._operator_digests = [bytes.fromhex(d) for d in config.operator_key_sha256]
        self.accounts = None if records is None else Accounts(records, frozenset(self.configured), frozenset(self._config_keys),
                                                              wall_clock)
        self.is_open = config.auth == "none"  # said by the config, never inferred from what a store holds
        self.stale_after_s = config.state.stale_after_s
        self._clock, self._wall_clock = clock, wall_clock
        self.snapshot = Snapshot()
        self._scales: dict[str, dict[AdapterName, float]] = {}  # each run-time tenant's default scales, kept across reads
        self._runtime: dict[str, Tenant] = {}
        self._reads = SharedReads(self.refresh, clock, read_s=float("-inf"))
        self._verify = verify
        self.refused: str | None = None  # why the state store was refused (every request then gets 503)
        self.went_back: str | None = None  # the store's version went below one this gateway had read
        self.read_ok_s: float | None = None if records is not None else float("inf")  # the last good read's start
        self.anonymous = Tenant(ANONYMOUS, None)

    @property
    def by_id(self) -> dict[str, Tenant]:
        """Every tenant: the config's and the run-time ones (a disabled one too), or the anonymous one."""
        if self.is_open:
            return {ANONYMOUS: self.anonymous}
        return {**self._runtime, **self.configured}

    # keeping up with the records

    async def refresh_if_stale(self) -> None:
        """A request's path: the records read again when the last read began over ACCOUNTS_POLL_S
        before it arrived (SharedReads: requests that come together share one read)."""
        if self.accounts is not None:
            await self._reads.since(self._clock() - ACCOUNTS_POLL_S)

    async def refresh(self) -> None:
        assert self.accounts is not None
        began_s = self._clock()
        if self._verify is not None:
            try:
                await self._verify()
            except StateStoreRefused as e:
                self.refused = str(e)
                log.error("%s", e)
                return
            except client_errors() as e:
                raise RegistryUnavailable(f"the state store cannot be checked ({type(e).__name__})") from e
            self._verify, self.refused = None, None
        version = await self.accounts.records.version()
        if version != self.snapshot.version:
            version, records = await self.accounts.load()
            if not self.apply(Snapshot.of(version, records)):
                return  # not a good read: the last one ages towards stale_after_s
        self.read_ok_s = began_s

    async def read_now(self) -> Snapshot:
        """The records read at once and applied (a change this gateway just made)."""
        assert self.accounts is not None
        began_s = self._clock()
        snapshot = Snapshot.of(*await self.accounts.load())
        if self.apply(snapshot):
            self.read_ok_s = began_s
        return snapshot

    def apply(self, snapshot: Snapshot) -> bool:
        """Take a newer read of the records (a change this gateway made is applied at once); False for an
        older one. Versions only go forward (gateway/registry/records.py): an older one is a store that
        lost its records or was put back to an earlier state, which could bring back a revoked key; it is
        not taken (said in the log and /health), and run-time keys are refused once the last good read is
        older than stale_after_s, until the store holds a newer version (the next change made there)."""
        if snapshot.version < self.snapshot.version:
            self.went_back = (f"the state store's accounts went back from version {self.snapshot.version} to "
                              f"{snapshot.version} (lost or restored from an older copy)")
            log.error("%s: not taken", self.went_back)
            return False
        self.went_back = None
        self.snapshot = snapshot
        self._runtime = {r.id: Tenant.from_record(r, self._scales.setdefault(r.id, {}))
                         for r in snapshot.tenants.values() if r.id not in self.configured}
        return True

    def _check_state(self, authorization_is_runtime: bool) -> None:
        """503 when the state store was refused, or (for a run-time key) when the records were not read
        within `stale_after_s`: a gateway never serves run-time keys from an unbounded stale view."""
        if self.refused is not None:
            raise GatewayError(503, f"this deployment cannot serve: {self.refused}", "state_store_refused", {"Retry-After": "30"})
        if not authorization_is_runtime:
            return
        if self.read_ok_s is None:
            raise GatewayError(503, "API keys cannot be read yet (the state store is unreachable)", "tenants_unavailable",
                           {"Retry-After": "5"})
        stale_s = self._clock() - self.read_ok_s
        if stale_s > self.stale_after_s:
            raise GatewayError(503, f"API keys were last read from the state store {stale_s:.0f} s ago, more than the "
                           f"{self.stale_after_s:g} s this gateway serves from a stale view", "tenants_unavailable",
                           {"Retry-After": "5"})

    # who is calling

    def authenticate(self, authorization: str | None) -> Tenant:
        """The calling tenant, as seen by this key (its `key_id` set); 401 for no key or a bad,
        revoked or expired one, 403 for a disabled tenant's, 503 while the state store is refused,
        or when a run-time key cannot be checked against a read of the records recent enough."""
        if self.is_open:
            self._check_state(False)
            return self.anonymous
        sha256 = _key_digest(authorization).hex()
        tenant_id = self._config_keys.get(sha256)
        key: KeyRecord | None = self.snapshot.keys_by_digest.get(sha256)
        if key is not None and key.revoked_s is not None:  # final, however stale the view
            self._check_state(False)
            raise GatewayError(401, "this API key has been revoked", "invalid_api_key")
        self._check_state(tenant_id is None)
        if tenant_id is not None:
            return replace(self.configured[tenant_id], key_id=config_key_id(sha256))
        if key is None or key.tenant not in self._runtime:
            raise GatewayError(401, "invalid API key", "invalid_api_key")
        if not key.is_valid(self._wall_clock()):
            raise GatewayError(401, "this API key has expired", "expired_api_key")
        if self.snapshot.tenants[key.tenant].is_disabled:
            raise GatewayError(403, "this tenant is disabled", "tenant_disabled")
        return replace(self._runtime[key.tenant], key_id=key.id)

    async def authenticate_fresh(self, authorization: str | None) -> Tenant:
        """`authenticate`, after one read of the records begun now when the key is not known here yet (one
        made a moment ago through another gateway): requests that wait together share that read."""
        try:
            return self.authenticate(authorization)
        except GatewayError as e:
            if e.status != 401 or self.accounts is None or not self._is_unknown(authorization):
                raise
        await self._reads.since(self._clock())
        if self._reads.has_failed and self._is_unknown(authorization):  # it may be a key made meanwhile
            raise GatewayError(503, "this API key cannot be checked now (the state store is unreachable)", "tenants_unavailable",
                           {"Retry-After": "1"})
        return self.authenticate(authorization)

    def _is_unknown(self, authorization: str | None) -> bool:
        try:
            digest = _key_digest(authorization).hex()
        except GatewayError:
            return False
        return digest not in self._config_keys and digest not in self.snapshot.keys_by_digest

    # operators

    @property
    def is_operator_open(self) -> bool:
        """An open deployment (auth: none) with no operator key configured: operator routes are open too."""
        return self.is_open and not self._operator_digests

    def operator(self, authorization: str | None) -> Operator | None:
        """The operator whose key this is: the config's (admin), or a live one made at run time; else None."""
        if self.is_operator_open:
            return Operator(OPEN_OPERATOR, ("admin",))
        if not authorization:
            return None
        try:
            digest = _key_digest(authorization)
        except GatewayError:
            return None
        if _match(digest, self._operator_digests):
            return Operator(config_key_id(digest.hex()), ("admin",))
        record = self.snapshot.operator_keys_by_digest.get(digest.hex())
        if record is None or not record.is_valid(self._wall_clock()):
            return None
        try:
            self._check_state(True)
        except GatewayError:
            return None  # a run-time operator key is not trusted from a view staler than the bound
        return Operator(record.id, record.scopes)

    def is_operator(self, authorization: str | None, scope: str = "admin") -> bool:
        """The caller holds an operator key that may act in `scope`."""
        found = self.operator(authorization)
        return found is not None and found.may(scope)

    def authenticate_operator(self, authorization: str | None, scope: str = "admin") -> Operator:
        """The operator calling, allowed `scope`; 401 for a key that is no operator's, 403 for one
        without that scope, 503 while the state store is refused."""
        if self.refused is not None:
            self._check_state(False)
        found = self.operator(authorization)
        if found is None:
            _key_digest(authorization)  # 401 for a missing or malformed header, in its own words
            raise GatewayError(401, "invalid operator key", "invalid_api_key")
        if not found.may(scope):
            raise GatewayError(403, f"this operator key may not do this: it needs the {scope!r} scope "
                           f"(it has {', '.join(found.scopes)})", "permission_denied")
        return found


def _key_digest(authorization: str | None) -> bytes:
    if not authorization:
        raise GatewayError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", "missing_api_key")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise GatewayError(401, "malformed Authorization header: expected 'Bearer YOUR_KEY'", "invalid_api_key")
    return hashlib.sha256(key.strip().encode()).digest()


def _match(digest: bytes, known: list[bytes]) -> bool:
    """Whether `digest` is one of `known`; every one is compared, in constant time."""
    found = False
    for candidate in known:
        found = hmac.compare_digest(candidate, digest) or found
    return found


def open_tenants(config: ServeConfig, clock: Callable[[], float] = time.monotonic) -> Tenants:
    """The deployment's tenants: the config's, and the run-time ones kept in its state store
    (gateway/state.py, checked before it is first read), or in a file beside the adapter files
    without Redis."""
    directory = Path(config.blob_store().cache_dir).expanduser()
    redis_config = config.state_redis()
    if redis_config is None:
        return Tenants(config, FileRecords(directory, name="tenants", record_type=AccountRecords), clock)
    from cache.l2 import connect

    client = connect(redis_config, is_async=True)
    records = RedisRecords(client, f"{redis_config.key_prefix}:", ack_timeout_s=redis_config.replica_ack_timeout_s,
                           name="tenants", record_type=AccountRecords)
    return Tenants(config, records, clock, verify=lambda: check(config.state, redis_config, client))
