"""The operators' audit log (torch-free): every change an operator makes (tenants, keys, operator
keys, shared adapters), who made it (the operator key's id), what, to what, and when.

Kept in the state store (gateway/state.py) as a Redis stream capped at MAX_ENTRIES (the oldest go
first), so every gateway replica writes to and reads one log; without Redis, a JSON-lines file
beside the adapter files (one machine). An entry is written after its change is committed; a
write that fails is logged as an error with the whole entry (the change stands: refusing it
after the fact would not undo it) and the answer carries a warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cache.l2 import client_errors

log = logging.getLogger(__name__)
MAX_ENTRIES = 100_000
MAX_READ = 1000


class AuditLog:
    """`client`: redis.asyncio's client of the state store, or None: `path` (a JSON-lines file)."""

    def __init__(self, client, key_prefix: str, path: Path | None = None, clock: Callable[[], float] = time.time) -> None:
        self.client, self.path, self.clock = client, path, clock
        self.key = f"{key_prefix}:audit"

    async def record(self, operator: str, action: str, target: str, detail: dict[str, Any] | None = None) -> str | None:
        """Write one entry; None, or a warning for the answer when it could not be written."""
        entry = {"at": round(self.clock(), 3), "operator": operator, "action": action, "target": target,
                 "detail": json.dumps(detail or {}, sort_keys=True)}
        try:
            if self.client is not None:
                await self.client.xadd(self.key, entry, maxlen=MAX_ENTRIES, approximate=True)
            elif self.path is not None:
                await asyncio.to_thread(_append, self.path, entry)
        except (*client_errors(), OSError) as e:
            log.error("audit entry not written (%s): %s", type(e).__name__, json.dumps(entry))
            return f"the change was made, but its audit entry could not be written ({type(e).__name__})"
        return None

    async def read(self, limit: int = 100, since_s: float | None = None) -> list[dict[str, Any]]:
        """The newest `limit` entries (at most MAX_READ), oldest first; from `since_s` on when given."""
        limit = max(1, min(limit, MAX_READ))
        if self.client is not None:
            low = "-" if since_s is None else f"{int(since_s * 1000)}-0"
            raw = await self.client.xrevrange(self.key, "+", low, count=limit)
            entries = [{_text(k): _text(v) for k, v in fields.items()} for _, fields in reversed(raw)]
        elif self.path is not None and self.path.exists():
            lines = (await asyncio.to_thread(self.path.read_text, encoding="utf-8")).splitlines()
            entries = [json.loads(line) for line in lines[-limit:]]
            if since_s is not None:
                entries = [e for e in entries if float(e["at"]) >= since_s]
        else:
            entries = []
        return [{"at": float(e["at"]), "operator": e["operator"], "action": e["action"], "target": e["target"],
                 "detail": json.loads(e["detail"])} for e in entries]


def _append(path: Path, entry: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_audit(redis_config, directory: Path) -> AuditLog:
    if redis_config is None:
        return AuditLog(None, "loraplex", directory / "audit.jsonl")
    from cache.l2 import connect

    return AuditLog(connect(redis_config, is_async=True), redis_config.key_prefix)
