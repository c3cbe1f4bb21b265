"""Which adapters a tenant may use, by its names (torch-free, pure): the config's adapters its
policy allows, the operator's shared ones likewise, and its own; another tenant's never.

A tenant whose policy lists its adapters is checked by content too: an adapter of its own that
holds a shared adapter its policy leaves out (by fingerprint: whoever registered it, under any
name) is not visible to it, and registering one is refused (gateway/registry/registry.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from gateway.catalog import AdapterInfo
from gateway.registry.records import PENDING, SHARED, AdapterRecord, Records
from worker.contract.identity import Fingerprint


class Caller(Protocol):
    """Who asks (a tenant, gateway/tenancy/tenants.py): its id, and the shared adapters its policy
    allows (None: every one)."""

    @property
    def id(self) -> str: ...
    @property
    def allowed(self) -> frozenset[str] | None: ...
    def may_use(self, name: str) -> bool: ...

def forbidden(tenant: Caller, seed: Mapping[str, AdapterInfo], records: Records) -> frozenset[Fingerprint]:
    """The content a tenant with a restricted policy may not be served under any name: that of the shared
    adapters (the config's, the operator's, staged ones too) it may not use, less what one it may use holds."""
    if tenant.allowed is None:
        return frozenset()
    shared = [(n, info.fingerprint, True) for n, info in seed.items()]  # (name, content, is committed)
    shared += [(r.name, r.fingerprint, not k.startswith(PENDING)) for k, r in records.items() if r.owner == SHARED]
    usable = {fp for n, fp, is_committed in shared if is_committed and tenant.may_use(n)}
    return frozenset(Fingerprint(fp) for n, fp, _ in shared if not tenant.may_use(n) and fp not in usable)


def visible(tenant: Caller, seed: Mapping[str, AdapterInfo], records: Records,
            info: Callable[[AdapterRecord], AdapterInfo]) -> dict[str, AdapterInfo]:
    """The adapters `tenant` may use, by its names: the shared ones first (config order, then by age),
    then its own by age, less those of its own whose content is `forbidden`."""
    out = {n: i for n, i in seed.items() if tenant.may_use(n)}
    committed = sorted((r for k, r in records.items() if not k.startswith(PENDING)), key=lambda r: (r.created_s, r.name))
    out.update((r.name, info(r)) for r in committed if r.owner == SHARED and tenant.may_use(r.name))
    hidden = forbidden(tenant, seed, records)
    out.update((r.name, info(r)) for r in committed if r.owner == tenant.id and r.fingerprint not in hidden)
    return out
