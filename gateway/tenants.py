"""Who is calling, and what they may use (torch-free).

API keys map to tenants through their SHA-256 digests (compared in constant
time); a tenant sees only the adapters its policy allows, and an adapter it
may not use answers exactly as an unknown one. Each tenant's prefix cache is
its own (salt = tenant id) unless it opts into the shared salt; a request's
`cache_salt` narrows that further, never widens it.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field

from gateway.api.protocol import APIError
from gateway.config import ServeConfig, TenantConfig
from worker.contract.identity import AdapterName

ANONYMOUS = "anonymous"
SHARED_SALT = "shared"


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

    def may_use(self, name: AdapterName) -> bool:
        return self.allowed is None or name in self.allowed

    def cache_salt(self, request_salt: str | None) -> str:
        base = SHARED_SALT if self.shared_cache else f"tenant:{self.id}"
        return base if not request_salt else f"{base}/{request_salt}"

    @classmethod
    def from_config(cls, t: TenantConfig) -> Tenant:
        allowed = None if t.adapters == "*" else frozenset(AdapterName(n) for n in t.adapters)
        return cls(t.id, allowed, t.requests_per_min, t.tokens_per_min, t.shared_cache, t.max_adapters,
                   t.max_adapter_bytes)


class Tenants:
    def __init__(self, config: ServeConfig) -> None:
        self.by_id = {t.id: Tenant.from_config(t) for t in config.tenants}
        self._digests = [(bytes.fromhex(d), t.id) for t in config.tenants for d in t.key_sha256]
        self._operator_digests = [(bytes.fromhex(d), "operator") for d in config.operator_key_sha256]
        self.is_open = not config.tenants  # no tenants configured: no auth, one anonymous tenant
        if self.is_open:
            self.by_id[ANONYMOUS] = Tenant(ANONYMOUS, None)

    def authenticate(self, authorization: str | None) -> Tenant:
        if self.is_open:
            return self.by_id[ANONYMOUS]
        found = _match(_key_digest(authorization), self._digests)
        if found is None:
            raise APIError(401, "invalid API key", "invalid_api_key")
        return self.by_id[found]

    @property
    def is_operator_open(self) -> bool:
        """Neither tenants nor operator keys configured: a local, unauthenticated deployment."""
        return self.is_open and not self._operator_digests

    def is_operator(self, authorization: str | None) -> bool:
        """The caller holds an operator key (never true without one configured)."""
        if not self._operator_digests or not authorization:
            return False
        try:
            return _match(_key_digest(authorization), self._operator_digests) is not None
        except APIError:
            return False

    def authenticate_operator(self, authorization: str | None) -> None:
        """401/403 unless the caller holds an operator key (or is_operator_open)."""
        if self.is_operator_open:
            return
        if not self._operator_digests:
            raise APIError(403, "this endpoint needs an operator key, and none is configured (operator_key_sha256)",
                           "operator_only")
        if _match(_key_digest(authorization), self._operator_digests) is None:
            raise APIError(401, "invalid operator key", "invalid_api_key")


def _key_digest(authorization: str | None) -> bytes:
    if not authorization:
        raise APIError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", "missing_api_key")
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise APIError(401, "malformed Authorization header: expected 'Bearer YOUR_KEY'", "invalid_api_key")
    return hashlib.sha256(key.strip().encode()).digest()


def _match(digest: bytes, known: list[tuple[bytes, str]]) -> str | None:
    """The owner of `digest`; every known digest is compared, in constant time."""
    found = None
    for candidate, owner in known:
        if hmac.compare_digest(candidate, digest):
            found = owner
    return found
