"""Operator keys made at run time (torch-free): their records and the changes to them (issue, rotate,
revoke), kept with the tenants and their keys (gateway/tenancy/accounts.py) in one versioned set of records.

The config's operator keys are the bootstrap: every scope, changed only in the config. A key made
here has scopes (SCOPES; `admin` is all of them, and alone may manage operator keys and read the
audit log), is shown once (`sk-lpop-...`), and is stored as gateway/tenancy/keys.py keeps every key.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from gateway.registry.records import Records, RecordStore, ReplicaDidNotAcknowledge
from gateway.tenancy.keys import AccountError, StoredKey, checked_request, digest, forgotten, known_fields, new_key_changes, revoked

SCOPES = ("admin", "tenants", "adapters", "usage", "observe")  # "admin": every one
MAX_OPERATOR_KEYS = 64
OPERATOR_KEY_PREFIX = "sk-lpop-"


@dataclass(frozen=True)
class OperatorKeyRecord(StoredKey):
    id: str
    sha256: str
    shown: str
    scopes: tuple[str, ...]
    name: str = ""
    created_s: float = 0.0
    created_by: str = ""  # the operator key that made it
    expires_s: float | None = None
    revoked_s: float | None = None
    kind: str = "operator_key"

    @property
    def key(self) -> str:
        return f"operator_key/{self.id}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OperatorKeyRecord:
        data = known_fields(cls, data)
        data["scopes"] = tuple(data.get("scopes") or ())
        return cls(**data)

    def public(self) -> dict[str, Any]:
        return {**super().public(), "scopes": list(self.scopes), "object": "operator_key"}


def operator_keys_of(records: Records) -> list[OperatorKeyRecord]:
    keys = (r for r in records.values() if isinstance(r, OperatorKeyRecord))
    return sorted(keys, key=lambda k: (k.created_s, k.id))


def checked_scopes(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v in SCOPES for v in value):
        raise AccountError(400, f"scopes: a non-empty list of {', '.join(SCOPES)}", "invalid_value")
    return tuple(dict.fromkeys(value))


class OperatorKeys:
    """The changes to operator keys, over the accounts' RecordStore."""

    def __init__(self, records: RecordStore, clock: Callable[[], float] = time.time) -> None:
        self.records, self.clock = records, clock

    async def issue(self, scopes: tuple[str, ...], by: str, name: str = "", expires_s: float | None = None,
                    replacing: str | None = None, old_expires_s: float | None = None,
                    ) -> tuple[str, OperatorKeyRecord, str | None]:
        """A new operator key with `scopes`, made by operator `by`: the key itself (shown once), its record,
        and a warning when no Redis replica acknowledged it. With `replacing` (rotation): that key ends at
        `old_expires_s` (now when None) in the same change, and the new one takes its scopes when none are given."""
        now_s = self.clock()
        checked_request(name, expires_s, now_s)
        key = OPERATOR_KEY_PREFIX + secrets.token_urlsafe(32)
        made: list[OperatorKeyRecord] = []  # the record of the last try (the change may run again)

        def issue(records: Records):
            record = OperatorKeyRecord("opk_" + secrets.token_hex(8), digest(key), key[:len(OPERATOR_KEY_PREFIX) + 4],
                                       scopes, name, now_s, by, expires_s)
            old = None
            if replacing is not None:
                old = records.get(f"operator_key/{replacing}")
                if not isinstance(old, OperatorKeyRecord):
                    raise AccountError(404, f"operator key {replacing!r} not found", "key_not_found")
                record = replace(record, scopes=scopes or old.scopes)
            if not record.scopes:
                raise AccountError(400, f"scopes: a non-empty list of {', '.join(SCOPES)}", "invalid_value")
            keys = operator_keys_of(records)
            live = [k for k in keys if k.is_valid(now_s)]
            changes = {**forgotten(keys, now_s),
                       **new_key_changes(old, live, MAX_OPERATOR_KEYS, now_s, old_expires_s, "this deployment"),
                       record.key: record}
            made.append(record)
            return changes, record

        try:
            await self.records.transact(issue)
        except ReplicaDidNotAcknowledge as e:  # committed on the master: the key works unless a failover loses it
            return key, made[-1], str(e)
        return key, made[-1], None

    async def revoke(self, key_id: str) -> OperatorKeyRecord:
        def revoke(records: Records):
            old = records.get(f"operator_key/{key_id}")
            if not isinstance(old, OperatorKeyRecord):
                raise AccountError(404, f"operator key {key_id!r} not found", "key_not_found")
            record = revoked(old, self.clock())
            return {record.key: record}, record

        return (await self.records.transact(revoke))[1]
