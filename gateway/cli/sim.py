"""`loraplex simulate` and `loraplex calibrate`: the fleet simulator in bench/sim and the cost
profiles it runs on."""

from __future__ import annotations

from gateway.cli.flags import Subparsers, device_flags, positive_int


def add_simulate(sub: Subparsers) -> None:
    p = sub.add_parser("simulate", help="a fleet of replicas in virtual time: the production routing, placement and "
                                        "admission against other routers, on a scenario (bench/sim)")
    p.add_argument("--scenario", required=True, metavar="FILE.yaml", help="e.g. bench/sim/scenarios/fleet-zipf.yaml")
    p.add_argument("--replicas", type=positive_int, default=8, metavar="N", help="replicas in the fleet (default 8)")
    p.add_argument("--policy", action="append", metavar="P",
                   help="router (repeatable; default all): ours, holders-then-p2c, scorer-mix, holders-only-least-loaded, "
                        "least-loaded, round-robin")
    p.add_argument("--seed", type=int, help="override the scenario's seed")
    p.add_argument("--duration-s", type=float, metavar="T", help="override the scenario's duration_s")
    p.add_argument("--rate-rps", type=float, metavar="R",
                   help="set load.rate_rps to R, every other rate and burst (tenants' own, phases') by the same factor")
    p.add_argument("--max-requests", type=positive_int, metavar="N", help="override the scenario's max_requests")
    p.add_argument("--profile", metavar="NAME|FILE.yaml", help="step costs and engine (bench/sim/profiles; default: the scenario's)")
    p.add_argument("--ttft-slo-s", type=float, help="override the scenario's slo.ttft_s")
    p.add_argument("--itl-slo-s", type=float, help="override the scenario's sim.itl_s")
    p.add_argument("--no-shared-cache", action="store_true", help="no Redis tier: each replica's own prefix cache only")
    p.add_argument("--device-adapters", type=positive_int, metavar="N",
                   help="workers with adapter tiers: N adapters on each device, the others they serve loaded on use")
    p.add_argument("--l2-fetch-token-s", type=float, metavar="S",
                   help="the shared tier's cost per token fetched (each replica then keeps its own L1 beside it)")
    p.add_argument("--l2-lookup-s", type=float, metavar="S", help="the shared tier's round trip per lookup (with --l2-fetch-token-s)")
    p.add_argument("--host-adapters", type=positive_int, metavar="N",
                   help="with --device-adapters: N adapters in each host's memory, the others loaded from below it")
    p.add_argument("--eps", type=float, metavar="E", help="ours: the bounded-load slack (routing.eps; default 0.25)")
    p.add_argument("--capacity", action="store_true", help="instead: the fewest replicas (up to --replicas) meeting the SLO, per router")
    p.add_argument("--autoscale", metavar="P,Q", help="instead: shards scaled by each policy (ours, fixed, serve-default, knative, "
                   "queue-depth), their replica-seconds and SLO share beside the fewest fixed replicas (up to --replicas) meeting the SLO")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--out", metavar="DIR", help="also write report.json, report.md and plots (PNG) there")
    p.set_defaults(handler="bench.sim.cli:run")


def add_calibrate(sub: Subparsers) -> None:
    p = sub.add_parser("calibrate", help="time the real engine's passes and fit a cost profile for simulate (bench/sim)")
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="the profile to write (simulate --profile FILE.yaml)")
    p.add_argument("--name", help="the profile's name (default: FILE's stem)")
    p.add_argument("--config", metavar="FILE.yaml", help="take the profile's engine section from this loraplex serve config")
    p.add_argument("--model", metavar="BASE.gguf", help="base model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lora", action="append", metavar="PATH", help="an adapter file (repeatable; default: random ones)")
    p.add_argument("--adapters", type=positive_int, default=4, metavar="N", help="random adapters without --lora (default 4)")
    p.add_argument("--rank", type=positive_int, default=8)
    p.add_argument("--targets", choices=["attn", "all"], default="attn", help="attn: q,k,v,o; all: the 7 linears")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds of every shape after a warm-up (medians fitted)")
    p.add_argument("--concurrent", type=positive_int, default=1, metavar="N",
                   help="time it while N - 1 other engines run the same rounds (N replicas sharing the cores)")
    p.add_argument("--seed", type=int, default=0)
    device_flags(p)
    p.set_defaults(handler="bench.sim.calibrate:run")
