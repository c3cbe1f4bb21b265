"""`loraplex keys ...`: a run-time tenant's API keys on a running server, over its HTTP API
(/v1/tenants/ID/keys), with the operator's key."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.cli.flags import Subparsers
from gateway.cli.remote import client, reaching_server, server_flags, show


def _key_row(k: dict[str, Any]) -> str:
    state = "revoked" if k.get("revoked_s") else "expires " + str(k["expires_s"]) if k.get("expires_s") else "live"
    return f"{k['id']:22s} {k.get('shown', '-'):14s} {k.get('name') or '-':16s} {state}"


@reaching_server
def run(args: argparse.Namespace) -> int:
    with client(args) as server:
        base = f"/v1/tenants/{args.tenant}/keys"
        if args.action == "list":
            return show(server.get(base), args.json, lambda b: "\n".join(_key_row(k) for k in b["data"]) or "(no keys)", "keys")
        if args.action == "revoke":
            return show(server.delete(f"{base}/{args.key_id}"), args.json, lambda b: f"revoked {b['id']}", "keys")
        body: dict[str, Any] = {}
        if args.name is not None:
            body["name"] = args.name
        if args.expires_in_s is not None:
            body["expires_in_s"] = args.expires_in_s
        if args.action == "rotate":
            body["grace_s"] = args.grace_s
            response = server.post(f"{base}/{args.key_id}/rotate", json=body)
        else:
            response = server.post(base, json=body)
        return show(response, args.json, lambda b: f"{b['key']}\n(key {b['id']}: shown this once, keep it now)", "keys")


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("keys", help="a run-time tenant's API keys: create, list, rotate, revoke")
    server_flags(p, "the operator's key", 30.0)
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
    p.set_defaults(handler=run)
