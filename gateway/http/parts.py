"""What a route receives (torch-free): each part of the gateway serving a request, as a FastAPI
dependency a route names in its signature (`catalog: CatalogPart`), so that a route says what it
uses and hands its helpers those parts, never the whole gateway. The parts are the composition
root's (gateway/compose.py), found per request: the app is made before its gateway is."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from gateway.catalog import Catalog
from gateway.config import ServeConfig
from gateway.http.incoming import gateway_of
from gateway.http.respond import Responder
from gateway.registry.registry import AdapterRegistry
from gateway.requests.admission import Admission
from gateway.requests.dispatch import Dispatcher
from gateway.requests.health import Health
from gateway.requests.response_store import ResponseStore
from gateway.tenancy.audit import AuditLog
from gateway.tenancy.tenants import Tenants
from gateway.tenancy.usage import UsageLedger


def _part(name: str) -> Any:
    def part(request: Request) -> Any:
        return getattr(gateway_of(request), name)

    part.__name__ = f"gateway_{name}"
    return Depends(part)


def _responder(request: Request) -> Responder:
    gateway = gateway_of(request)
    return Responder(gateway.dispatcher, gateway.admission, gateway.metrics, gateway.catalog.model_name)


ConfigPart = Annotated[ServeConfig, _part("config")]
CatalogPart = Annotated[Catalog, _part("catalog")]
AdmissionPart = Annotated[Admission, _part("admission")]
TenantsPart = Annotated[Tenants, _part("tenants")]
RegistryPart = Annotated[AdapterRegistry, _part("registry")]
UsagePart = Annotated[UsageLedger, _part("usage")]
AuditPart = Annotated[AuditLog, _part("audit")]
ResponsesPart = Annotated[ResponseStore, _part("responses")]
DispatcherPart = Annotated[Dispatcher, _part("dispatcher")]
HealthPart = Annotated[Health, _part("health")]
ResponderPart = Annotated[Responder, Depends(_responder)]
