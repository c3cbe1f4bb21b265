"""`loraplex loadtest`'s flags; the run itself is gateway/loadtest/cli.py."""

from __future__ import annotations

from gateway.cli.flags import Subparsers, positive_int


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("loadtest", help="skewed multi-tenant traffic against a loraplex server, with a report")
    p.add_argument("--scenario", required=True, metavar="FILE.yaml", help="e.g. deploy/scenarios/zipf.yaml")
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, metavar="S", help="override the scenario's duration_s")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--max-requests", type=positive_int, metavar="N", help="override the scenario's max_requests")
    p.add_argument("--out", metavar="DIR", help="report directory (default loadtest-<scenario>)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler="gateway.loadtest.cli:run")
