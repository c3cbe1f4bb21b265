"""`loraplex usage`: usage per tenant, key, adapter, model and hour from a running server's
/v1/usage, with the operator's key (or a tenant's, which reads its own)."""

from __future__ import annotations

import argparse
import json
import sys

from gateway.cli.flags import Subparsers
from gateway.cli.remote import client, reaching_server, server_flags, show


@reaching_server
def run(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("tenant", args.tenant), ("start", args.start), ("end", args.end)) if v}
    with client(args) as server:
        if args.format in ("csv", "jsonl"):
            response = server.get("/v1/usage", params={**params, "format": args.format})
            if response.status_code >= 400:
                return show(response, False, str, "usage")
            sys.stdout.write(response.text)
            return 0
        return show(server.get("/v1/usage", params=params), args.json,
                    lambda b: f"{b['start']} .. {b['end']}\n" + json.dumps(b["totals"], indent=2), "usage")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("usage", help="usage per tenant, key, adapter, model and hour (a tenant's key: its own)")
    server_flags(p, "the operator's key, or a tenant's", 60.0)
    p.add_argument("--tenant", help="operator only: one tenant")
    p.add_argument("--start", help="Unix seconds or ISO 8601 (default: this UTC month)")
    p.add_argument("--end", help="Unix seconds or ISO 8601 (default: now)")
    p.add_argument("--format", choices=("totals", "csv", "jsonl"), default="totals")
    p.set_defaults(handler=run)
