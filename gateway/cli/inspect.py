"""`loraplex inspect`: a GGUF model or adapter's metadata, tensors, fingerprint and validation."""

from __future__ import annotations

from gateway.cli.flags import Subparsers


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("inspect", help="show a GGUF model or adapter: metadata, tensors, fingerprint, validation")
    p.add_argument("file", metavar="FILE.gguf")
    p.add_argument("--base", metavar="BASE.gguf", help="validate an adapter against this base model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler="worker.cli.inspect:run")
