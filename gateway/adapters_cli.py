"""`loraplex adapters add|list|rm`: the adapter registry of a running server, over its HTTP
API (POST/GET/DELETE /v1/adapters), as a tenant (its key) or the operator (the operator key)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import httpx

EXIT_REFUSED = 1


def _client(args: argparse.Namespace) -> httpx.Client:
    key = args.key or os.environ.get("LORAPLEX_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout)


def _show(response: httpx.Response, as_json: bool, line, command: str = "adapters") -> int:
    """The answer's `line` (its JSON with `as_json`); an error's message on stderr and EXIT_REFUSED."""
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"message": response.text[:500]}}
    if response.status_code >= 400:
        print(f"loraplex {command}: {response.status_code}: {body.get('error', {}).get('message', body)}", file=sys.stderr)
        return EXIT_REFUSED
    print(json.dumps(body, indent=2) if as_json else line(body))
    return 0


def _row(a: dict) -> str:
    where = ",".join(a.get("shards") or []) or ("config" if a.get("source") == "config" else "-")
    owner = f"  owner={a['owner']}" if a.get("owner") else ""
    return (f"{a['name']:24s} {a['fingerprint'][:16]}  rank={a.get('rank', '-')}  size={a.get('size_bytes', '-')}  "
            f"{'shared' if a.get('shared') else 'own':6s} ready={str(a.get('ready')).lower()}  on={where}{owner}")


def run(args: argparse.Namespace) -> int:
    owner = {"owner": args.owner} if getattr(args, "owner", None) else {}
    try:
        with _client(args) as client:
            if args.action == "list":
                return _show(client.get("/v1/adapters"), args.json, lambda b: "\n".join(_row(a) for a in b["data"]) or "(no adapters)")
            if args.action == "rm":
                return _show(
                    client.delete(f"/v1/adapters/{args.name}", params=owner),
                    args.json,
                    lambda b: f"removed {b['name']} ({b['fingerprint'][:16]})",
                )
            files = _files(args)
            try:
                response = client.post(
                    "/v1/adapters", params=owner, data={"name": args.name}, files={k: (Path(f.name).name, f) for k, f in files.items()}
                )
            finally:
                for f in files.values():
                    f.close()
            return _show(
                response,
                args.json,
                lambda b: ("replaced" if b.get("replaced") else "added") + " " + _row(b) + f"  (ready in {b['ready_s']} s)",
            )
    except OSError as e:
        print(f"loraplex adapters: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"loraplex adapters: cannot reach {args.url}: {e}", file=sys.stderr)
        return 2


def _files(args: argparse.Namespace) -> dict:
    path = Path(args.path)
    if path.is_dir():  # a PEFT adapter directory
        return {name: open(path / name, "rb") for name in ("adapter_config.json", "adapter_model.safetensors")}
    return {"file": open(path, "rb")}


def server_flags(p: argparse.ArgumentParser, key_help: str, timeout_s: float = 300.0) -> None:
    """--url, --key, --timeout and --json: how a command reaches a running server."""
    p.add_argument(
        "--url", default=os.environ.get("LORAPLEX_URL", "http://127.0.0.1:8000"), help="the server (default $LORAPLEX_URL or :8000)"
    )
    p.add_argument("--key", help=f"{key_help} (default $LORAPLEX_API_KEY)")
    p.add_argument("--timeout", type=float, default=timeout_s)
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")


def add_parser(sub) -> None:
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
    p.set_defaults(handler="gateway.adapters_cli:run")
