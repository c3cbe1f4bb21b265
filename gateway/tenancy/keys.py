"""What every API key made at run time shares, a tenant's or an operator's (torch-free): the key is
shown once, only its SHA-256 digest is stored with an id, its first characters, a name and an
expiry; a revoked or expired key's record is forgotten FORGET_ENDED_KEYS_S later; a rotation ends
the old key at once or after a grace period, in the same change that makes the new one; and a
holder has at most a limit of live keys, the old key of a rotation with a grace period counted
(a rotation that ends the old key now is always allowed). The changes themselves are the
records' owners' (gateway/tenancy/accounts.py for tenants' keys, gateway/tenancy/operators.py for operators')."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, fields, replace
from typing import Any, Protocol

MAX_KEY_NAME_CHARS = 128
FORGET_ENDED_KEYS_S = 30 * 24 * 3600  # a revoked or expired key's record is dropped this long after


class AccountError(ValueError):
    """A change the operator asked for that cannot be made; `status` is its HTTP status."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class KeyFields(Protocol):
    key: str
    revoked_s: float | None
    expires_s: float | None


class StoredKey:
    """The methods a key record's dataclass shares (its fields: `sha256`, `shown`, `expires_s`, `revoked_s`)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    def is_valid(self, now_s: float) -> bool:
        return self.revoked_s is None and (self.expires_s is None or now_s < self.expires_s)

    def public(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("kind", "sha256")}
        out["shown"] = self.shown + "..."
        return out


def known_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """`data` without the fields `cls` does not have (a field a newer gateway wrote: rolling upgrades)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in data.items() if k in names}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def checked_request(name: Any, expires_s: float | None, now_s: float) -> None:
    """AccountError 400 for a key's name or expiry that cannot be."""
    if not isinstance(name, str) or len(name) > MAX_KEY_NAME_CHARS:
        raise AccountError(400, f"name: at most {MAX_KEY_NAME_CHARS} characters", "invalid_value")
    if expires_s is not None and expires_s <= now_s:
        raise AccountError(400, "the key's expiry is in the past", "invalid_value")


def forgotten(keys: list, now_s: float) -> dict[str, None]:
    """The changes that drop keys revoked or expired long ago (the set every gateway reads stays small)."""
    return {k.key: None for k in keys if _ended_s(k) < now_s - FORGET_ENDED_KEYS_S}


def _ended_s(key: KeyFields) -> float:
    ended = [t for t in (key.revoked_s, key.expires_s) if t is not None]
    return min(ended) if ended else float("inf")


def new_key_changes(old: Any, live: list, limit: int, now_s: float, old_expires_s: float | None,
                    what: str) -> dict[str, Any]:
    """For a new key beside `live` ones, with `old` the key it replaces (None: none): the old key's record
    ended at `old_expires_s` (now when None; never later than it would have), or AccountError 403 when
    the new key would make more than `limit` live."""
    changes: dict[str, Any] = {}
    is_ending_old_now = False
    if old is not None:
        until_s = now_s if old_expires_s is None else min(old_expires_s, old.expires_s or old_expires_s)
        changes[old.key] = replace(old, expires_s=until_s)
        is_ending_old_now = until_s <= now_s  # the new key takes its place; otherwise both are live for a while
    if not is_ending_old_now and len(live) >= limit:
        hint = "revoke one, or rotate with no grace period (grace_s 0)" if old is not None else "revoke one first"
        raise AccountError(403, f"{what} has {len(live)} live keys, the most it may: {hint}", "key_limit")
    return changes


def revoked(old: Any, now_s: float) -> Any:
    """The record of `old` revoked now (as it is when it already was)."""
    return old if old.revoked_s is not None else replace(old, revoked_s=now_s)
