"""`loraplex tenants ...`: a running server's run-time tenants, over its HTTP API (/v1/tenants),
with the operator's key."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.cli.flags import Subparsers
from gateway.cli.remote import client, reaching_server, server_flags, show

SETTINGS = ("requests_per_min", "tokens_per_min", "tokens_per_day", "tokens_per_month", "max_adapters", "max_adapter_bytes")


def _tenant_row(t: dict[str, Any]) -> str:
    limits = " ".join(f"{name}={t[name]}" for name in SETTINGS[:4] if t.get(name) is not None)
    adapters = t["adapters"] if t["adapters"] == "*" else ",".join(t["adapters"]) or "-"
    state = "disabled" if t.get("is_disabled") else "enabled"
    return f"{t['id']:24s} {t.get('source', 'api'):6s} {state:8s} keys={len(t.get('keys', []))}  adapters={adapters}  {limits}".rstrip()


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}
    if getattr(args, "adapters", None) is not None:
        body["adapters"] = "*" if args.adapters == "*" else [a for a in args.adapters.split(",") if a]
    if getattr(args, "shared_cache", None) is not None:
        body["shared_cache"] = args.shared_cache
    return body


@reaching_server
def run(args: argparse.Namespace) -> int:
    with client(args) as server:
        if args.action == "list":
            return show(server.get("/v1/tenants"), args.json, lambda b: "\n".join(_tenant_row(t) for t in b["data"]) or "(no tenants)",
                        "tenants")
        if args.action == "show":
            return show(server.get(f"/v1/tenants/{args.id}"), True, str, "tenants")
        if args.action == "create":
            return show(server.post("/v1/tenants", json={"id": args.id, **_settings(args)}), args.json, _tenant_row, "tenants")
        if args.action == "delete":
            return show(server.delete(f"/v1/tenants/{args.id}"), args.json, lambda b: f"deleted {b['id']}", "tenants")
        body = _settings(args) if args.action == "update" else {"disabled": args.action == "disable"}
        return show(server.patch(f"/v1/tenants/{args.id}", json=body), args.json, _tenant_row, "tenants")


def _tenant_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", help="the adapters it may use: a,b,c or * (every one)")
    for name in SETTINGS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, metavar="N")
    p.add_argument("--shared-cache", dest="shared_cache", action=argparse.BooleanOptionalAction, default=None,
                   help="share the prefix cache's salt with the other tenants that do")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("tenants", help="a running server's run-time tenants: create, list, update, disable, delete")
    server_flags(p, "the operator's key", 30.0)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="every tenant (the config file's too)")
    for action, what in (("show", "one tenant and its keys"), ("delete", "a tenant, its keys and its adapters"),
                         ("disable", "refuse its keys until enabled"), ("enable", "take its keys again")):
        actions.add_parser(action, help=what).add_argument("id")
    for action, what in (("create", "a new tenant (then: loraplex keys create ID)"), ("update", "change its settings")):
        a = actions.add_parser(action, help=what)
        a.add_argument("id")
        _tenant_settings(a)
    p.set_defaults(handler=run)
