"""Operator keys at run time and the audit log (torch-free): `/v1/operator/keys[/{id}[/rotate]]`
and `/v1/operator/audit`.

The config's operator keys are the bootstrap: they may do everything and cannot be changed here.
With one, an operator makes, rotates and revokes operator keys of its own, each with scopes
(gateway/tenancy/operators.py SCOPES: `admin`, `tenants`, `adapters`, `usage`, `observe`), shown once
when made. Every route here needs the `admin` scope; every change is in the audit log, which
`GET /v1/operator/audit` reads (newest `limit`, from `since`, a Unix time, on).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.api.admin.tenants import audited, expiry, grace_s, operator_accounts
from gateway.errors import GatewayError
from gateway.http.incoming import read_parsed
from gateway.http.parts import AuditPart, ConfigPart, TenantsPart
from gateway.tenancy.keys import AccountError
from gateway.tenancy.operators import MAX_OPERATOR_KEYS, OperatorKeyRecord, OperatorKeys, checked_scopes, operator_keys_of
from gateway.tenancy.tenants import Tenants, config_key_id

router = APIRouter()


async def _admin(request: Request, tenants: Tenants) -> OperatorKeys:
    accounts = await operator_accounts(request, tenants, "admin")
    return OperatorKeys(accounts.records, accounts.clock)


def _scopes(body: dict[str, Any], required: bool) -> tuple[str, ...]:
    if "scopes" not in body and not required:
        return ()
    try:
        return checked_scopes(body.get("scopes"))
    except AccountError as e:
        raise GatewayError(e.status, str(e), e.code) from e


def _shown(record: OperatorKeyRecord, key: str | None = None, warning: str | None = None) -> dict[str, Any]:
    out = record.public()
    if key is not None:
        out["key"] = key
    if warning is not None:
        out["warning"] = warning
    return out


@router.get("/v1/operator/keys")
async def list_operator_keys(request: Request, config: ConfigPart, tenants: TenantsPart) -> dict[str, Any]:
    await _admin(request, tenants)
    _, records = await tenants.accounts.load()
    configured = [{"object": "operator_key", "id": config_key_id(d), "scopes": ["admin"], "source": "config"}
                  for d in config.operator_key_sha256]
    return {"object": "list", "data": configured + [{**k.public(), "source": "api"} for k in operator_keys_of(records)],
            "max_keys": MAX_OPERATOR_KEYS}


@router.post("/v1/operator/keys")
async def issue_operator_key(request: Request, tenants: TenantsPart, audit: AuditPart) -> JSONResponse:
    keys = await _admin(request, tenants)
    body = await read_parsed(request, dict[str, Any])
    scopes = _scopes(body, required=True)
    try:
        key, record, warning = await keys.issue(scopes, request.state.operator.id, body.get("name", ""),
                                                expiry(body, keys.clock()))
    except AccountError as e:
        raise GatewayError(e.status, str(e), e.code) from e
    await tenants.read_now()
    warned = await audited(request, audit, "operator_key.issue", record.id, scopes=list(record.scopes), name=record.name)
    return JSONResponse({**_shown(record, key, warning), **warned}, status_code=201)


@router.post("/v1/operator/keys/{key_id}/rotate")
async def rotate_operator_key(request: Request, key_id: str, tenants: TenantsPart, audit: AuditPart) -> JSONResponse:
    """A new key in the old one's place (its scopes unless others are given); the old one works `grace_s` more."""
    keys = await _admin(request, tenants)
    body = await read_parsed(request, dict[str, Any])
    grace, now_s = grace_s(body), keys.clock()
    try:
        key, record, warning = await keys.issue(_scopes(body, required=False), request.state.operator.id,
                                                body.get("name", ""), expiry(body, now_s), replacing=key_id,
                                                old_expires_s=now_s + float(grace))
    except AccountError as e:
        raise GatewayError(e.status, str(e), e.code) from e
    await tenants.read_now()
    warned = await audited(request, audit, "operator_key.rotate", key_id, new_key=record.id, grace_s=grace)
    return JSONResponse({**_shown(record, key, warning), "replaces": key_id, **warned}, status_code=201)


@router.delete("/v1/operator/keys/{key_id}")
async def revoke_operator_key(request: Request, key_id: str, tenants: TenantsPart, audit: AuditPart) -> dict[str, Any]:
    keys = await _admin(request, tenants)
    try:
        record = await keys.revoke(key_id)
    except AccountError as e:
        raise GatewayError(e.status, str(e), e.code) from e
    await tenants.read_now()
    return {**_shown(record), **await audited(request, audit, "operator_key.revoke", key_id)}


@router.get("/v1/operator/audit")
async def audit_log(request: Request, tenants: TenantsPart, audit: AuditPart) -> dict[str, Any]:
    await _admin(request, tenants)
    try:
        limit = int(request.query_params.get("limit", "100"))
        since = request.query_params.get("since")
        since_s = None if since is None else float(since)
    except ValueError as e:
        raise GatewayError(400, "limit: an integer; since: a Unix time in seconds", "invalid_value") from e
    if since_s is not None and not 0 <= since_s < 1e11:  # NaN and infinities fail this too
        raise GatewayError(400, "since: a Unix time in seconds", "invalid_value")
    return {"object": "list", "data": await audit.read(limit, since_s)}
