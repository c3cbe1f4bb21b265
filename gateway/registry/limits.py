"""A new adapter as the registry records it (`describe`), and its owner's limits (how many, how many
bytes) checked against the records (`check_limits`: the owner's other names count, staged versions
at their new size). Pure and torch-free."""

from __future__ import annotations

import time

from gateway.errors import GatewayError
from gateway.registry.records import PENDING, AdapterRecord, Records
from worker.formats.adapter import LoRAAdapter


def check_limits(records: Records, fresh: AdapterRecord, limits: tuple[int, int]) -> None:
    """A 403 when `fresh` takes its owner past `limits` (count, bytes): the owner's other names count,
    their staged versions at their new size."""
    mine: dict[str, AdapterRecord] = {}
    for k, r in records.items():
        if r.owner == fresh.owner and r.name != fresh.name and (r.name not in mine or k.startswith(PENDING)):
            mine[r.name] = r
    count, size = limits
    if len(mine) + 1 > count:
        raise GatewayError(403, f"this key already has {len(mine)} adapters, its limit is {count}: delete one first",
                           "adapter_quota_exceeded")
    used = sum(r.size_bytes for r in mine.values())
    if used + fresh.size_bytes > size:
        raise GatewayError(403, f"this adapter ({fresh.size_bytes} bytes) would take this key's adapters to "
                           f"{used + fresh.size_bytes} bytes, over its limit of {size}", "adapter_quota_exceeded")


def describe(adapter: LoRAAdapter, owner: str, name: str, size: int) -> AdapterRecord:
    kinds = sorted({t.split(".")[-2] if t.count(".") >= 2 else t.split(".")[0] for t in adapter.pairs})
    rank = max((p.rank for p in adapter.pairs.values()), default=0)
    return AdapterRecord(owner, name, adapter.fingerprint, size, rank, tuple(kinds), adapter.alpha,
                         adapter.invocation_tokens, adapter.task_name, adapter.prompt_prefix, time.time(),
                         is_dora=adapter.is_dora, chat_template=adapter.chat_template)
