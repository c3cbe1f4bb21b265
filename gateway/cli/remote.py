"""What the commands that talk to a running server share: their flags, the HTTP client, and how
an answer is printed."""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import httpx

EXIT_REFUSED = 1

Handler = Callable[[argparse.Namespace], int]


def server_flags(p: argparse.ArgumentParser, key_help: str, timeout_s: float = 300.0) -> None:
    """--url, --key, --timeout and --json: how a command reaches a running server."""
    p.add_argument(
        "--url", default=os.environ.get("LORAPLEX_URL", "http://127.0.0.1:8000"), help="the server (default $LORAPLEX_URL or :8000)"
    )
    p.add_argument("--key", help=f"{key_help} (default $LORAPLEX_API_KEY)")
    p.add_argument("--timeout", type=float, default=timeout_s)
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")


def client(args: argparse.Namespace) -> httpx.Client:
    key = args.key or os.environ.get("LORAPLEX_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=args.timeout)


def show(response: httpx.Response, as_json: bool, line: Callable[[Any], str], command: str) -> int:
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


def reaching_server(handler: Handler) -> Handler:
    """`handler`, with a server it cannot reach said on stderr (exit 2) rather than as a traceback."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except httpx.HTTPError as e:
            print(f"loraplex: cannot reach {args.url}: {e}", file=sys.stderr)
            return 2

    return run
