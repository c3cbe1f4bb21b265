"""`loraplex adapters add|list|rm`: the adapter registry of a running server, over its HTTP
API (POST/GET/DELETE /v1/adapters), as a tenant (its key) or the operator (the operator key)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from gateway.cli.flags import Subparsers
from gateway.cli.remote import client, server_flags, show


def _row(a: dict[str, Any]) -> str:
    where = ",".join(a.get("shards") or []) or ("config" if a.get("source") == "config" else "-")
    owner = f"  owner={a['owner']}" if a.get("owner") else ""
    return (f"{a['name']:24s} {a['fingerprint'][:16]}  rank={a.get('rank', '-')}  size={a.get('size_bytes', '-')}  "
            f"{'shared' if a.get('shared') else 'own':6s} ready={str(a.get('ready')).lower()}  on={where}{owner}")


def run(args: argparse.Namespace) -> int:
    owner = {"owner": args.owner} if getattr(args, "owner", None) else {}
    try:
        with client(args) as server:
            if args.action == "list":
                return show(server.get("/v1/adapters"), args.json,
                            lambda b: "\n".join(_row(a) for a in b["data"]) or "(no adapters)", "adapters")
            if args.action == "rm":
                return show(server.delete(f"/v1/adapters/{args.name}", params=owner), args.json,
                            lambda b: f"removed {b['name']} ({b['fingerprint'][:16]})", "adapters")
            return _add(server, args, owner)
    except OSError as e:
        print(f"loraplex adapters: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"loraplex adapters: cannot reach {args.url}: {e}", file=sys.stderr)
        return 2


def _add(server: httpx.Client, args: argparse.Namespace, owner: dict[str, str]) -> int:
    files = _files(args)
    try:
        response = server.post(
            "/v1/adapters", params=owner, data={"name": args.name}, files={k: (Path(f.name).name, f) for k, f in files.items()}
        )
    finally:
        for f in files.values():
            f.close()
    return show(response, args.json,
                lambda b: ("replaced" if b.get("replaced") else "added") + " " + _row(b) + f"  (ready in {b['ready_s']} s)",
                "adapters")


def _files(args: argparse.Namespace) -> dict[str, BinaryIO]:
    path = Path(args.path)
    if path.is_dir():  # a PEFT adapter directory, and the chat template it ships, if any
        names = ["adapter_config.json", "adapter_model.safetensors"]
        names += [name for name in ("tokenizer_config.json", "chat_template.jinja") if (path / name).is_file()]
        return {name: open(path / name, "rb") for name in names}
    return {"file": open(path, "rb")}


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("adapters", help="add, list or remove adapters of a running server (its registry)")
    server_flags(p, "API key: a tenant's, or the operator's for shared adapters")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    add = actions.add_parser("add", help="upload a GGUF adapter, or a PEFT directory (converted by the server); the same name replaces")
    add.add_argument("name")
    add.add_argument("path", metavar="FILE.gguf|PEFT_DIR")
    add.add_argument("--owner", help="operator only: the tenant it is for")
    actions.add_parser("list", help="the adapters this key may use")
    rm = actions.add_parser("rm", help="remove an adapter (running requests finish)")
    rm.add_argument("name")
    rm.add_argument("--owner", help="operator only: the tenant whose adapter it is")
    p.set_defaults(handler=run)
