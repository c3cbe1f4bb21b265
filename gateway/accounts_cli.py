"""`loraplex tenants ...`, `loraplex keys ...` and `loraplex usage`: a running server's run-time
tenants, their keys and their usage, over its HTTP API (/v1/tenants, /v1/usage), with the
operator's key (usage: a tenant's key reads its own)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import httpx

from gateway.adapters_cli import _client, _show, server_flags

SETTINGS = ("requests_per_min", "tokens_per_min", "tokens_per_day", "tokens_per_month", "max_adapters", "max_adapter_bytes")


def _tenant_row(t: dict[str, Any]) -> str:
    limits = " ".join(f"{name}={t[name]}" for name in SETTINGS[:4] if t.get(name) is not None)
    adapters = t["adapters"] if t["adapters"] == "*" else ",".join(t["adapters"]) or "-"
    state = "disabled" if t.get("is_disabled") else "enabled"
    return f"{t['id']:24s} {t.get('source', 'api'):6s} {state:8s} keys={len(t.get('keys', []))}  adapters={adapters}  {limits}".rstrip()


def _key_row(k: dict[str, Any]) -> str:
    state = "revoked" if k.get("revoked_s") else "expires " + str(k["expires_s"]) if k.get("expires_s") else "live"
    return f"{k['id']:22s} {k.get('shown', '-'):14s} {k.get('name') or '-':16s} {state}"


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {name: getattr(args, name) for name in SETTINGS if getattr(args, name, None) is not None}
    if getattr(args, "adapters", None) is not None:
        body["adapters"] = "*" if args.adapters == "*" else [a for a in args.adapters.split(",") if a]
    if getattr(args, "shared_cache", None) is not None:
        body["shared_cache"] = args.shared_cache
    return body


def run_tenants(args: argparse.Namespace) -> int:
    with _client(args) as client:
        if args.action == "list":
            return _show(client.get("/v1/tenants"), args.json, lambda b: "\n".join(_tenant_row(t) for t in b["data"]) or "(no tenants)",
                         "tenants")
        if args.action == "show":
            return _show(client.get(f"/v1/tenants/{args.id}"), True, str, "tenants")
        if args.action == "create":
            return _show(client.post("/v1/tenants", json={"id": args.id, **_settings(args)}), args.json, _tenant_row, "tenants")
        if args.action == "delete":
            return _show(client.delete(f"/v1/tenants/{args.id}"), args.json, lambda b: f"deleted {b['id']}", "tenants")
        body = _settings(args) if args.action == "update" else {"disabled": args.action == "disable"}
        return _show(client.patch(f"/v1/tenants/{args.id}", json=body), args.json, _tenant_row, "tenants")


def run_keys(args: argparse.Namespace) -> int:
    with _client(args) as client:
        base = f"/v1/tenants/{args.tenant}/keys"
        if args.action == "list":
            return _show(client.get(base), args.json, lambda b: "\n".join(_key_row(k) for k in b["data"]) or "(no keys)", "keys")
        if args.action == "revoke":
            return _show(client.delete(f"{base}/{args.key_id}"), args.json, lambda b: f"revoked {b['id']}", "keys")
        body: dict[str, Any] = {}
        if args.name is not None:
            body["name"] = args.name
        if args.expires_in_s is not None:
            body["expires_in_s"] = args.expires_in_s
        if args.action == "rotate":
            body["grace_s"] = args.grace_s
            response = client.post(f"{base}/{args.key_id}/rotate", json=body)
        else:
            response = client.post(base, json=body)
        return _show(response, args.json, lambda b: f"{b['key']}\n(key {b['id']}: shown this once, keep it now)", "keys")


def run_usage(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("tenant", args.tenant), ("start", args.start), ("end", args.end)) if v}
    with _client(args) as client:
        if args.format in ("csv", "jsonl"):
            response = client.get("/v1/usage", params={**params, "format": args.format})
            if response.status_code >= 400:
                return _show(response, False, str, "usage")
            sys.stdout.write(response.text)
            return 0
        return _show(client.get("/v1/usage", params=params), args.json,
                     lambda b: f"{b['start']} .. {b['end']}\n" + json.dumps(b["totals"], indent=2), "usage")


def _runs(handler):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except httpx.HTTPError as e:
            print(f"loraplex: cannot reach {args.url}: {e}", file=sys.stderr)
            return 2

    return run


run_tenants, run_keys, run_usage = _runs(run_tenants), _runs(run_keys), _runs(run_usage)


def _tenant_settings(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapters", help="the adapters it may use: a,b,c or * (every one)")
    for name in SETTINGS:
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, metavar="N")
    p.add_argument("--shared-cache", dest="shared_cache", action=argparse.BooleanOptionalAction, default=None,
                   help="share the prefix cache's salt with the other tenants that do")


def add_parsers(sub) -> None:
    operator = "the operator's key"
    p = sub.add_parser("tenants", help="a running server's run-time tenants: create, list, update, disable, delete")
    server_flags(p, operator, 30.0)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="every tenant (the config file's too)")
    for action, what in (("show", "one tenant and its keys"), ("delete", "a tenant, its keys and its adapters"),
                         ("disable", "refuse its keys until enabled"), ("enable", "take its keys again")):
        actions.add_parser(action, help=what).add_argument("id")
    for action, what in (("create", "a new tenant (then: loraplex keys create ID)"), ("update", "change its settings")):
        a = actions.add_parser(action, help=what)
        a.add_argument("id")
        _tenant_settings(a)
    p.set_defaults(handler="gateway.accounts_cli:run_tenants")

    p = sub.add_parser("keys", help="a run-time tenant's API keys: create, list, rotate, revoke")
    server_flags(p, operator, 30.0)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", help="its keys (never the keys themselves)").add_argument("tenant")
    for action in ("create", "rotate"):
        a = actions.add_parser(action, help="a new key, printed once" if action == "create" else "a new key in an old one's place")
        a.add_argument("tenant")
        if action == "rotate":
            a.add_argument("key_id")
            a.add_argument("--grace-s", dest="grace_s", type=float, default=0.0, help="the old key works this long (default 0)")
        a.add_argument("--name")
        a.add_argument("--expires-in-s", dest="expires_in_s", type=float, metavar="S")
    revoke = actions.add_parser("revoke", help="refuse a key from now on")
    revoke.add_argument("tenant")
    revoke.add_argument("key_id")
    p.set_defaults(handler="gateway.accounts_cli:run_keys")

    p = sub.add_parser("usage", help="usage per tenant, key, adapter, model and hour (a tenant's key: its own)")
    server_flags(p, "the operator's key, or a tenant's", 60.0)
    p.add_argument("--tenant", help="operator only: one tenant")
    p.add_argument("--start", help="Unix seconds or ISO 8601 (default: this UTC month)")
    p.add_argument("--end", help="Unix seconds or ISO 8601 (default: now)")
    p.add_argument("--format", choices=("totals", "csv", "jsonl"), default="totals")
    p.set_defaults(handler="gateway.accounts_cli:run_usage")
