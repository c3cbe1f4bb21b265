"""The operator's tenants and keys (torch-free): `/v1/tenants[/{id}[/keys[/{key_id}[/rotate]]]]`.

Every route takes an operator key with the `tenants` scope (gateway/tenancy/tenants.py): run-time tenants
are never made by an unauthenticated caller. A change is answered once it is committed
(gateway/tenancy/accounts.py), and this gateway applies it at once; the others within ACCOUNTS_POLL_S.
Every change is written to the audit log (gateway/tenancy/audit.py) with the operator key that made it.
Tenants from the config file are listed (`source: config`) and cannot be changed here.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.config import ServeConfig
from gateway.errors import GatewayError
from gateway.http.incoming import credentials, read_parsed
from gateway.http.parts import AuditPart, ConfigPart, RegistryPart, TenantsPart
from gateway.tenancy.accounts import AccountError, Accounts, KeyRecord, Snapshot, checked_fields, keys_of
from gateway.tenancy.audit import AuditLog
from gateway.tenancy.tenants import OPEN_OPERATOR, Tenant, Tenants, config_key_id

router = APIRouter()
MAX_EXPIRY_S = 10 * 365 * 24 * 3600


async def operator_accounts(request: Request, tenants: Tenants, scope: str = "tenants") -> Accounts:
    """The run-time records, for an operator key with `scope` (its operator in
    `request.state.operator`). Credentials are made only with an operator key: an open deployment's
    anonymous caller (auth: none, no operator key) makes none, which would outlive the open mode."""
    await tenants.refresh_if_stale()  # run-time operator keys, as fresh as tenants' keys
    request.state.operator = tenants.authenticate_operator(credentials(request), scope)
    if request.state.operator.id == OPEN_OPERATOR:
        raise GatewayError(403, "making tenants and keys needs an operator key (operator_key_sha256 or "
                       "operator_key_file): this deployment is open (auth: none) and has none", "operator_only")
    if tenants.accounts is None:
        raise GatewayError(503, "this gateway keeps no run-time records", "tenants_unavailable")
    return tenants.accounts


async def audited(request: Request, audit: AuditLog, action: str, target: str, **detail: Any) -> dict[str, str]:
    """The change written to the audit log as the calling operator's; a warning for the answer if it could not be."""
    warning = await audit.record(request.state.operator.id, action, target, detail)
    return {} if warning is None else {"audit_warning": warning}


async def _body(request: Request) -> dict[str, Any]:
    return await read_parsed(request, dict[str, Any])


async def _changed(tenants: Tenants) -> Snapshot:
    """The records after a change, applied to this gateway's view at once."""
    return await tenants.read_now()


def _config_tenant(tenant: Tenant, digests: list[str]) -> dict[str, Any]:
    return {"id": tenant.id, "source": "config", "adapters": "*" if tenant.allowed is None else sorted(tenant.allowed),
            "requests_per_min": tenant.requests_per_min, "tokens_per_min": tenant.tokens_per_min,
            "tokens_per_day": tenant.tokens_per_day, "tokens_per_month": tenant.tokens_per_month,
            "shared_cache": tenant.shared_cache, "max_adapters": tenant.max_adapters,
            "max_adapter_bytes": tenant.max_adapter_bytes, "adapter_paths": list(tenant.adapter_paths), "is_disabled": False,
            "keys": [{"id": config_key_id(d), "source": "config"} for d in digests]}


def _tenant(tenants: Tenants, config: ServeConfig, snapshot: Snapshot, tenant_id: str) -> dict[str, Any]:
    if tenant_id in tenants.configured:
        digests = [d for t in config.tenants if t.id == tenant_id for d in t.key_sha256]
        return _config_tenant(tenants.configured[tenant_id], digests)
    record = snapshot.tenants.get(tenant_id)
    if record is None:
        raise GatewayError(404, f"tenant {tenant_id!r} not found", "tenant_not_found")
    keys = [k for k in snapshot.keys_by_digest.values() if k.tenant == tenant_id]
    return {**record.public(), "source": "api", "keys": [_key(k) for k in sorted(keys, key=lambda k: k.created_s)]}


def _key(record: KeyRecord) -> dict[str, Any]:
    return {**record.public(), "object": "api_key"}


def expiry(body: dict[str, Any], now_s: float, field: str = "expires_in_s") -> float | None:
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_EXPIRY_S:
        raise GatewayError(400, f"{field}: seconds, more than 0 and at most {MAX_EXPIRY_S}", "invalid_value")
    return now_s + float(value)


def _warned(warning: str | None) -> dict[str, str]:
    return {} if warning is None else {"warning": warning}


def _plain(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings as JSON has them (tuples as lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}


def grace_s(body: dict[str, Any]) -> float:
    """A rotation's `grace_s`: how long the old key keeps working (default 0: refused now)."""
    grace = body.get("grace_s", 0)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= MAX_EXPIRY_S:
        raise GatewayError(400, f"grace_s: seconds, from 0 to {MAX_EXPIRY_S}", "invalid_value")
    return grace


def _answer(e: AccountError) -> GatewayError:
    return GatewayError(e.status, str(e), e.code)


@router.get("/v1/tenants")
async def list_tenants(request: Request, config: ConfigPart, tenants: TenantsPart) -> dict[str, Any]:
    await operator_accounts(request, tenants)
    snapshot = await _changed(tenants)
    ids = [*tenants.configured, *sorted(i for i in snapshot.tenants if i not in tenants.configured)]
    return {"object": "list", "data": [_tenant(tenants, config, snapshot, i) for i in ids]}


@router.post("/v1/tenants")
async def create_tenant(request: Request, config: ConfigPart, tenants: TenantsPart, audit: AuditPart) -> JSONResponse:
    accounts = await operator_accounts(request, tenants)
    body = await _body(request)
    try:
        settings = checked_fields(body)
        await accounts.create_tenant(body.get("id"), settings)
    except AccountError as e:
        raise _answer(e) from e
    snapshot = await _changed(tenants)
    warned = await audited(request, audit, "tenant.create", body["id"], **_plain(settings))
    return JSONResponse({**_tenant(tenants, config, snapshot, body["id"]), **warned}, status_code=201)


@router.get("/v1/tenants/{tenant_id}")
async def get_tenant(request: Request, tenant_id: str, config: ConfigPart, tenants: TenantsPart) -> dict[str, Any]:
    await operator_accounts(request, tenants)
    return _tenant(tenants, config, await _changed(tenants), tenant_id)


@router.patch("/v1/tenants/{tenant_id}")
async def update_tenant(request: Request, tenant_id: str, config: ConfigPart, tenants: TenantsPart, audit: AuditPart) -> dict[str, Any]:
    accounts = await operator_accounts(request, tenants)
    body = await _body(request)
    try:
        settings = checked_fields(body)
        await accounts.update_tenant(tenant_id, settings)
    except AccountError as e:
        raise _answer(e) from e
    warned = await audited(request, audit, "tenant.update", tenant_id, **_plain(settings))
    return {**_tenant(tenants, config, await _changed(tenants), tenant_id), **warned}


@router.delete("/v1/tenants/{tenant_id}")
async def delete_tenant(request: Request, tenant_id: str, tenants: TenantsPart, registry: RegistryPart, audit: AuditPart) -> dict[str, Any]:
    """The tenant, its keys, and the adapters it registered."""
    accounts = await operator_accounts(request, tenants)
    if tenant_id in tenants.configured:
        raise GatewayError(409, f"tenant {tenant_id!r} is defined in the deployment config; change it there", "config_tenant")
    if tenant_id not in (await _changed(tenants)).tenants:
        raise GatewayError(404, f"tenant {tenant_id!r} not found", "tenant_not_found")
    for adapter in registry.owned(tenant_id):  # first: a failure here leaves the tenant, to delete again
        await registry.unregister(tenant_id, adapter.name)
    try:
        record = await accounts.delete_tenant(tenant_id)
    except AccountError as e:
        raise _answer(e) from e
    await _changed(tenants)
    warned = await audited(request, audit, "tenant.delete", tenant_id)
    return {"id": record.id, "object": "tenant.deleted", "deleted": True, **warned}


@router.post("/v1/tenants/{tenant_id}/keys")
async def issue_key(request: Request, tenant_id: str, tenants: TenantsPart, audit: AuditPart) -> JSONResponse:
    """A new key, shown this once."""
    accounts = await operator_accounts(request, tenants)
    body = await _body(request)
    try:
        key, record, warning = await accounts.issue_key(tenant_id, body.get("name", ""), expiry(body, accounts.clock()))
    except AccountError as e:
        raise _answer(e) from e
    await _changed(tenants)
    warned = await audited(request, audit, "key.issue", f"{tenant_id}/{record.id}", name=record.name,
                           expires_s=record.expires_s)
    return JSONResponse({**_key(record), "key": key, **_warned(warning), **warned}, status_code=201)


@router.get("/v1/tenants/{tenant_id}/keys")
async def list_keys(request: Request, tenant_id: str, config: ConfigPart, tenants: TenantsPart) -> dict[str, Any]:
    await operator_accounts(request, tenants)
    return {"object": "list", "data": _tenant(tenants, config, await _changed(tenants), tenant_id)["keys"]}


@router.delete("/v1/tenants/{tenant_id}/keys/{key_id}")
async def revoke_key(request: Request, tenant_id: str, key_id: str, tenants: TenantsPart, audit: AuditPart) -> dict[str, Any]:
    """The key is refused from now on (on every gateway within ACCOUNTS_POLL_S)."""
    accounts = await operator_accounts(request, tenants)
    try:
        record = await accounts.revoke_key(tenant_id, key_id)
    except AccountError as e:
        raise _answer(e) from e
    await _changed(tenants)
    return {**_key(record), **await audited(request, audit, "key.revoke", f"{tenant_id}/{key_id}")}


@router.post("/v1/tenants/{tenant_id}/keys/{key_id}/rotate")
async def rotate_key(request: Request, tenant_id: str, key_id: str, tenants: TenantsPart, audit: AuditPart) -> JSONResponse:
    """A new key in the old one's place; the old one keeps working for `grace_s` (default 0: refused now)."""
    accounts = await operator_accounts(request, tenants)
    body = await _body(request)
    now_s = accounts.clock()
    grace = grace_s(body)
    _, records = await accounts.load()
    old = next((k for k in keys_of(records, tenant_id) if k.id == key_id), None)
    name = body.get("name", old.name if old is not None else "")
    try:
        key, record, warning = await accounts.issue_key(tenant_id, name, expiry(body, now_s), replacing=key_id,
                                                        old_expires_s=now_s + float(grace))
    except AccountError as e:
        raise _answer(e) from e
    await _changed(tenants)
    warned = await audited(request, audit, "key.rotate", f"{tenant_id}/{key_id}", new_key=record.id, grace_s=grace)
    return JSONResponse({**_key(record), "key": key, "replaces": key_id, **_warned(warning), **warned}, status_code=201)
