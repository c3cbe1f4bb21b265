"""`loraplex serve`: the deployment on Ray Serve (gateway/launch.py runs it)."""

from __future__ import annotations

from gateway.cli.flags import Subparsers, positive_int


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI and llama-server APIs on Ray Serve (a local Ray, or a cluster joined)")
    p.add_argument("--config", metavar="FILE.yaml",
                   help="deployment config (default: deploy/serve.yaml: "
                        "the default model, example adapters and tenants)")
    p.add_argument("--host", help="override http.host")
    p.add_argument("--port", type=positive_int, help="override http.port")
    p.add_argument("--allow-insecure-bind", action="store_true", help="http.allow_insecure_bind (gateway/exposure.py)")
    p.add_argument("--ray-address", metavar="ADDR",
                   help="join the Ray cluster at ADDR (host:port of its head; default $RAY_ADDRESS) instead of starting a local Ray")
    p.add_argument("--verbose", action="store_true", help="show Ray's and the replicas' logs")
    p.set_defaults(handler="gateway.launch:run")
