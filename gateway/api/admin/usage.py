"""`GET /v1/usage` (torch-free): hourly usage rows (gateway/tenancy/usage.py) for a period, as JSON, JSON
lines or CSV. A tenant's key sees its own; the operator's every tenant's, or one with `?tenant=`.

`start` and `end` are Unix seconds or ISO 8601 dates/times (UTC when no zone is given); by default
the current UTC month up to now. A period is at most MAX_QUERY_HOURS long.
"""

from __future__ import annotations

import csv
import io
import json
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from gateway.errors import GatewayError
from gateway.http.incoming import begin, credentials
from gateway.http.parts import TenantsPart, UsagePart
from gateway.tenancy.usage import MAX_QUERY_HOURS
from gateway.tenancy.usage_event import COUNTS, FINISH_REASONS

router = APIRouter()
FORMATS = {"json": "application/json", "jsonl": "application/x-ndjson", "csv": "text/csv"}
LAST_S = 253402300799.0  # 9999-12-31T23:59:59Z
MAX_ROWS_READ = 200_000  # tenants x hours one query reads
COLUMNS = ("hour", "tenant", "key_id", "adapter", "model", *COUNTS, *(f"finish_{r}" for r in FINISH_REASONS))


def _time(value: str | None, name: str, default_s: float) -> float:
    """Unix seconds or ISO 8601, from 1970 to 9999."""
    if value is None or value == "":
        return default_s
    bad = GatewayError(400, f"{name}: Unix seconds or an ISO 8601 date or time from 1970 to 9999, got {value[:64]!r}",
                   "invalid_value")
    try:
        moment_s = float(value)
    except ValueError:
        try:
            moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as e:
            raise bad from e
        moment_s = (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    if not 0 <= moment_s <= LAST_S:  # NaN too
        raise bad
    return moment_s


def _month_start(now_s: float) -> float:
    t = time.gmtime(now_s)
    return datetime(t.tm_year, t.tm_mon, 1, tzinfo=UTC).timestamp()


def _totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    return {c: sum(int(r[c]) for r in rows) for c in COLUMNS[5:]}


@router.get("/v1/usage")
async def usage(request: Request, tenants: TenantsPart, usage: UsagePart) -> Response:
    asked = request.query_params.get("tenant")
    await tenants.refresh_if_stale()
    if tenants.is_operator(credentials(request), "usage"):
        known = set(tenants.by_id) | await usage.tenants_with_usage()
        ids = [asked] if asked else sorted(known)
    else:
        tenant, _ = await begin(request)
        if asked not in (None, "", tenant.id):
            raise GatewayError(403, "a tenant's key reads its own usage only", "permission_denied")
        ids = [tenant.id]
    now_s = time.time()
    start_s = _time(request.query_params.get("start"), "start", _month_start(now_s))
    end_s = _time(request.query_params.get("end"), "end", now_s + 1)
    if not start_s < end_s:
        raise GatewayError(400, "start must be before end", "invalid_value")
    if end_s - start_s > MAX_QUERY_HOURS * 3600 + 3600:
        raise GatewayError(400, f"a period is at most {MAX_QUERY_HOURS // 24} days: ask for several", "invalid_value")
    num_hours = (end_s - start_s) / 3600 + 1
    if len(ids) * num_hours > MAX_ROWS_READ:
        raise GatewayError(400, f"{len(ids)} tenants over {int(num_hours)} hours is more than one query reads: ask for a "
                       "shorter period or one tenant (?tenant=)", "invalid_value")
    fmt = request.query_params.get("format", "json")
    if fmt not in FORMATS:
        raise GatewayError(400, f"format: one of {', '.join(FORMATS)}", "invalid_value")
    rows = await usage.rows(ids, start_s, end_s)
    if fmt == "jsonl":
        return Response("".join(json.dumps(r) + "\n" for r in rows), media_type=FORMATS[fmt])
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), media_type=FORMATS[fmt])
    period = {"start": datetime.fromtimestamp(start_s, UTC).isoformat(), "end": datetime.fromtimestamp(end_s, UTC).isoformat()}
    return JSONResponse({"object": "list", **period, "data": rows, "totals": _totals(rows)})
