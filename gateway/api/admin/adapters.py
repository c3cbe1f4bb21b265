"""Adapters at run time over HTTP (docs/adapters.md#adapters-at-run-time), torch-free: `POST/GET/DELETE
/v1/adapters[/{name}]`, and vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`
over the same registry (gateway/registry/).

A tenant's key manages that tenant's names; the operator's key manages the shared ones
(and, with `?owner=`, any known tenant's). An upload (gateway/http/uploads.py) has its own size
limit. A bad file is a 400 with llama.cpp's message and changes nothing.

Loading by server path (`/v1/load_lora_adapter`'s `lora_path`) reads only under the
directories `registry.allowed_paths` names: the operator's key loads from any of them; a
tenant's key only from those of them its tenant's own `adapter_paths` name too (none: a 403
`path_not_allowed`, and the tenant uploads its adapters instead). Whatever the route, a
tenant whose ACL lists its adapters may not register the content of a shared adapter the
list leaves out (a 403 `adapter_not_allowed`; gateway/registry/registry.py).
"""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.admin.tenants import audited
from gateway.catalog import AdapterInfo
from gateway.config import NAME, ServeConfig
from gateway.errors import GatewayError
from gateway.http.incoming import begin, credentials, read_parsed
from gateway.http.parts import AuditPart, CatalogPart, ConfigPart, RegistryPart, TenantsPart
from gateway.http.uploads import ReadAdapter, adapter_reader, read_form
from gateway.registry.records import SHARED, AdapterRecord
from gateway.registry.registry import AdapterRegistry
from gateway.registry.store import InvalidAdapter, PathNotAllowed, read_server_path
from gateway.tenancy.audit import AuditLog
from gateway.tenancy.tenants import Tenant, Tenants
from worker.formats.adapter import LoRAAdapter

router = APIRouter()


class LoadLoRARequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=64)
    lora_path: str = Field(max_length=4096)
    load_inplace: bool = False  # replace an adapter already loaded under that name


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(max_length=64)
    lora_int_id: int | None = None


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise GatewayError(400, "name: a form field with the adapter's name is required", "invalid_value")
    if not re.match(NAME, name):
        raise GatewayError(400, f"name: {name[:80]!r} is not a valid adapter name (letters, digits, '.', '_', '-'; "
                       "at most 64; starting with a letter or digit)", "invalid_value")
    return name


def entry(name: str, info: AdapterInfo, record: AdapterRecord | None, registry: AdapterRegistry,
          is_operator: bool) -> dict[str, Any]:
    """An adapter as GET /v1/adapters shows it (no path, no other tenant's name; its own chat template
    to its owner and the operator, whether it has one to everyone)."""
    out: dict[str, Any] = {
        "object": "adapter", "name": name, "fingerprint": info.fingerprint, "shared": info.owner == SHARED,
        "task_name": info.task_name, "prompt_prefix": info.prompt_prefix,
        "alora_invocation_tokens": list(info.invocation_tokens) if info.invocation_tokens else None,
        "has_chat_template": info.chat_template is not None,
    }
    if is_operator or info.owner != SHARED:  # a tenant sees no other tenant's adapter: a non-shared one is its own
        out["chat_template"] = info.chat_template
    if is_operator:
        out["owner"] = info.owner or None
    if record is not None:
        out.update(rank=record.rank, targets=list(record.targets), size_bytes=record.size_bytes, alpha=record.alpha,
                   created=int(record.created_s), shards=list(record.shards),
                   ready=registry.is_held(record.fingerprint, record.shards))
    else:
        out.update(ready=True, source="config")
    return out


async def _caller(request: Request, tenants: Tenants, registry: AdapterRegistry) -> tuple[str, Tenant | None]:
    """(owner, tenant or None for the operator)."""
    registry.ensure_running()
    await tenants.refresh_if_stale()  # run-time operator keys, as fresh as tenants' keys
    operator = tenants.operator(credentials(request))
    if operator is not None and operator.may("adapters"):
        request.state.operator = operator  # its changes are audited under its key's id
        return SHARED, None
    tenant, _ = await begin(request)
    return tenant.id, tenant


async def _audited(request: Request, audit: AuditLog, tenant: Tenant | None, action: str, owner: str, name: str,
                   **detail: Any) -> dict[str, str]:
    """An operator's change to the registry, in the audit log (a tenant's own changes are its usage's business)."""
    return {} if tenant is not None else await audited(request, audit, action, f"{owner or 'shared'}/{name}", **detail)


def _owner_of(request: Request, owner: str, tenant: Tenant | None) -> str:
    asked = request.query_params.get("owner")
    if asked is None:
        return owner
    if tenant is not None:
        raise GatewayError(403, "owner= is for the operator's key", "operator_only")
    return asked


async def _register(registry: AdapterRegistry, owner: str, tenant: Tenant | None, name: str, read: ReadAdapter,
                    replace_existing: bool = True) -> tuple[dict[str, Any], AdapterRecord | None]:
    """Check the adapter `read(scratch)` reads (in a thread), then register it; (the response entry,
    the record it replaced)."""
    scratch = Path(tempfile.mkdtemp(prefix=".staging-", dir=registry.store.directory))
    try:
        try:
            adapter = await asyncio.to_thread(read, scratch)
        except InvalidAdapter as e:
            raise GatewayError(400, str(e), "invalid_adapter") from e
        limits = None if tenant is None else (tenant.max_adapters, tenant.max_adapter_bytes)
        record, replaced, ready_s = await registry.register(owner, name, adapter, Path(adapter.path), limits,
                                                            replace_existing, tenant)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = entry(name, registry.info(record), record, registry, tenant is None)
    out.update(replaced=replaced.fingerprint if replaced is not None else None, ready_s=round(ready_s, 3))
    return out, replaced


@router.post("/v1/adapters")
async def upload(request: Request, config: ConfigPart, catalog: CatalogPart, tenants: TenantsPart, registry: RegistryPart,
                 audit: AuditPart) -> JSONResponse:
    owner, tenant = await _caller(request, tenants, registry)
    owner = _owner_of(request, owner, tenant)
    if tenant is None and owner != SHARED:
        await tenants.refresh_if_stale()
        if owner not in tenants.by_id:
            raise GatewayError(404, f"tenant {owner[:80]!r} not found", "tenant_not_found")
    form = await read_form(request, config.registry.max_upload_bytes)
    try:
        name = _check_name(form.get("name"))
        out, replaced = await _register(registry, owner, tenant, name, adapter_reader(form, catalog.base))
    finally:
        await form.close()
    out |= await _audited(request, audit, tenant, "adapter.upload", owner, name, fingerprint=out["fingerprint"])
    return JSONResponse(out, status_code=200 if replaced is not None else 201)


def _visible(registry: AdapterRegistry, tenant: Tenant | None) -> list[tuple[str, AdapterInfo, AdapterRecord | None]]:
    """(name, info, its registry record or None for a config adapter) of what the caller sees."""
    if tenant is not None:  # its own record wins over a shared one of that name (one it cannot see)
        records = {r.name: r for r in registry.owned(SHARED)} | {r.name: r for r in registry.owned(tenant.id)}
        return [(n, info, records.get(n) if records.get(n) and records[n].fingerprint == info.fingerprint else None)
                for n, info in registry.visible(tenant).items()]
    shared = [(n, info, None) for n, info in registry.seed.items()]
    return shared + [(r.name, registry.info(r), r) for r in registry.owned(None)]


@router.get("/v1/adapters")
async def list_adapters(request: Request, tenants: TenantsPart, registry: RegistryPart) -> dict[str, Any]:
    _, tenant = await _caller(request, tenants, registry)
    await registry.refresh_if_stale()
    rows = _visible(registry, tenant)
    return {"object": "list",
            "data": [entry(n, info, record, registry, tenant is None) for n, info, record in rows]}


@router.get("/v1/adapters/{name}")
async def get_adapter(name: str, request: Request, tenants: TenantsPart, registry: RegistryPart) -> dict[str, Any]:
    owner, tenant = await _caller(request, tenants, registry)
    owner = _owner_of(request, owner, tenant)
    await registry.refresh_if_stale()
    for n, info, record in _visible(registry, tenant):
        if n == name and (tenant is not None or info.owner == owner):
            return entry(n, info, record, registry, tenant is None)
    raise GatewayError(404, f"adapter {name[:80]!r} not found", "adapter_not_found")


async def _delete(registry: AdapterRegistry, owner: str, tenant: Tenant | None, name: str) -> AdapterRecord:
    if tenant is not None:
        visible = registry.visible(tenant).get(name)
        if visible is not None and visible.owner != tenant.id:
            raise GatewayError(403, f"adapter {name!r} is shared with this key by the operator; only the operator can "
                           "remove it", "shared_adapter")
    return await registry.unregister(owner, name)


@router.delete("/v1/adapters/{name}")
async def delete_adapter(name: str, request: Request, tenants: TenantsPart, registry: RegistryPart,
                         audit: AuditPart) -> dict[str, Any]:
    owner, tenant = await _caller(request, tenants, registry)
    owner = _owner_of(request, owner, tenant)
    record = await _delete(registry, owner, tenant, name)
    warned = await _audited(request, audit, tenant, "adapter.delete", owner, name, fingerprint=record.fingerprint)
    return {"object": "adapter.deleted", "name": name, "fingerprint": record.fingerprint, "deleted": True, **warned}


def _own_paths(tenants: Tenants, config: ServeConfig, tenant: Tenant | None) -> list[Path] | None:
    """The directories a caller's lora_path must lie in besides registry.allowed_paths: None for
    the operator (and an open deployment's caller, who holds its authority); a tenant's own
    adapter_paths (relative: to the config file), a 403 when it has none."""
    if tenant is None or tenants.is_operator_open:
        return None
    if not tenant.adapter_paths:
        raise GatewayError(403, "loading an adapter by server path is the operator's: this key may upload adapters "
                       "(POST /v1/adapters), its tenant has no adapter_paths to load from", "path_not_allowed")
    return [config.resolve(p) for p in tenant.adapter_paths]


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, config: ConfigPart, catalog: CatalogPart, tenants: TenantsPart, registry: RegistryPart,
                            audit: AuditPart) -> PlainTextResponse:
    owner, tenant = await _caller(request, tenants, registry)
    body = await read_parsed(request, LoadLoRARequest)
    name = _check_name(body.lora_name)
    roots, base_dir = config.allowed_paths(), Path(config.base_dir)
    within = _own_paths(tenants, config, tenant)

    def read(scratch: Path) -> LoRAAdapter:
        try:
            return read_server_path(body.lora_path, roots, base_dir, catalog.base, scratch, within)
        except PathNotAllowed as e:
            raise _Refused(403, str(e), "path_not_allowed") from e
        except FileNotFoundError as e:
            raise _Refused(404, str(e), "adapter_path_not_found") from e
        except (ValueError, OSError) as e:  # a path no file system can name (a lone surrogate, a NUL, too long)
            raise _Refused(400, "lora_path: not a usable path", "invalid_value") from e

    try:
        out, _ = await _register(registry, owner, tenant, name, read, replace_existing=body.load_inplace)
    except _Refused as e:
        raise GatewayError(e.status, e.message, e.code) from None
    await _audited(request, audit, tenant, "adapter.load", owner, name, fingerprint=out["fingerprint"], path=body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, tenants: TenantsPart, registry: RegistryPart, audit: AuditPart) -> PlainTextResponse:
    owner, tenant = await _caller(request, tenants, registry)
    body = await read_parsed(request, UnloadLoRARequest)
    record = await _delete(registry, owner, tenant, body.lora_name)
    await _audited(request, audit, tenant, "adapter.unload", owner, body.lora_name, fingerprint=record.fingerprint)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
