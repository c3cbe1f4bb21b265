"""The operator's routes (torch-free): `/health` and `/metrics`. They take an operator key with
the `observe` scope (gateway/tenancy/tenants.py), not a tenant's, and count against no rate limit."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from gateway.http.incoming import credentials
from gateway.http.parts import DispatcherPart, HealthPart, TenantsPart

router = APIRouter()


@router.get("/health")
@router.get("/v1/health")  # llama-server's alias
async def health(request: Request, tenants: TenantsPart, health: HealthPart) -> JSONResponse:
    """Public, as llama-server's: liveness only (the gateway answers), whatever key comes with it.
    With the operator key: every shard and replica, and the cache's Redis state (503 when a shard
    has no healthy replica)."""
    await tenants.refresh_if_stale()  # a revoked run-time operator key: refused within the poll bound
    if not tenants.is_operator(credentials(request), "observe"):
        return JSONResponse({"status": "ok"})
    report = await health.full()
    return JSONResponse(report, status_code=200 if report["status"] != "down" else 503)


@router.get("/metrics")
async def metrics(request: Request, tenants: TenantsPart, dispatcher: DispatcherPart) -> PlainTextResponse:
    await tenants.refresh_if_stale()
    tenants.authenticate_operator(credentials(request), "observe")
    return PlainTextResponse(await dispatcher.full_metrics(), media_type="text/plain; version=0.0.4")
