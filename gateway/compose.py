"""The composition root (torch-free): the one place a gateway's parts are built from its config and
tied together. Ray Serve's ingress (gateway/serve.py) builds one per gateway replica; tests
build one over a fake pool. A route receives the parts it uses from it as FastAPI dependencies
(gateway/http/parts.py), never the whole.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from gateway.catalog import Catalog
from gateway.cluster.pool import ShardPool
from gateway.config import ServeConfig
from gateway.metrics import GatewayMetrics
from gateway.registry.registry import AdapterRegistry, open_registry
from gateway.requests.admission import Admission
from gateway.requests.dispatch import Dispatcher
from gateway.requests.health import Health
from gateway.requests.response_store import open_response_store
from gateway.requests.tracing import open_tracing
from gateway.tenancy.audit import open_audit
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.tenants import open_tenants
from gateway.tenancy.usage import open_ledger


class Gateway:
    """Every part of one gateway: who is calling (`tenants`, `limiter`), what they may use
    (`registry`, `catalog`), the bill (`usage`, `audit`), the request path (`admission`,
    `dispatcher`, `health`), stored responses, metrics and traces."""

    def __init__(self, config: ServeConfig, catalog: Catalog, pool: ShardPool, limiter: RateLimiter | None = None,
                 metrics: GatewayMetrics | None = None, clock: Callable[[], float] = time.monotonic,
                 registry: AdapterRegistry | None = None) -> None:
        cache_dir = Path(config.blob_store().cache_dir).expanduser()
        self.config, self.catalog, self.pool = config, catalog, pool
        self.tenants = open_tenants(config, clock)
        self.limiter = limiter or RateLimiter()
        self.registry = registry or open_registry(config, catalog, pool, clock)
        self.usage = open_ledger(config.state_redis(), spool_dir=cache_dir / "usage-spool")
        self.audit = open_audit(config.state_redis(), cache_dir)
        self.responses = open_response_store(config)  # the Responses API's stored responses
        self.admission = Admission(config, catalog, self.limiter, self.registry, clock, self.usage)
        self.metrics = metrics or GatewayMetrics()
        self.tracing = open_tracing(config.tracing, "gateway")
        self.dispatcher = Dispatcher(config, pool, self.registry, self.metrics, self.tracing.tracer, clock)
        self.health = Health(self.dispatcher, self.tenants, self.registry, clock)
