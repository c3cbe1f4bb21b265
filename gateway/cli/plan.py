"""`loraplex plan`: shards and replicas from adapters, traffic, workers and capacity.

Prints a deployment fragment (`--format config`: the `adapters` and `shards` of a
`loraplex serve` config; `helm-values`: the same under `loraplex:` for the Helm
chart's values) on stdout, and explains it on stderr: expected load per replica,
max/mean, copies of the hottest adapters.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import yaml

from gateway.cli.flags import Subparsers, positive_int
from gateway.policy.placement import AdapterSpec, PlacementError, plan

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_capacity(text: str) -> tuple[int | None, int | None]:
    """`16` -> 16 adapters per worker; `512MiB`, `2GB` -> bytes per worker."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise PlacementError(f"capacity must be a number of adapters (16) or of bytes (512MiB, 2GB), got {text!r}")
    if not m.group(2):
        if "." in m.group(1):
            raise PlacementError(f"capacity in adapters must be a whole number, got {text!r}")
        return int(m.group(1)), None
    return None, int(float(m.group(1)) * UNITS[m.group(2).lower()])


def _load(path: str) -> object:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise PlacementError(f"cannot read {path}: {e.strerror or e}") from e
    if path.endswith(".json"):
        return json.loads(text)
    return text


def read_adapters(path: str) -> list[AdapterSpec]:
    """A list of {name, path|uri, size}, or a loraplex config (its `adapters`)."""
    try:
        data = yaml.safe_load(_load(path)) if not path.endswith(".json") else _load(path)
    except yaml.YAMLError as e:
        raise PlacementError(f"{path}: not valid YAML: {e}") from e
    if isinstance(data, dict):
        data = data.get("adapters")
    if not isinstance(data, list) or not data:
        raise PlacementError(f"{path}: expected a list of adapters ({{name, path, size}}) or a config with 'adapters'")
    specs = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise PlacementError(f"{path}: adapters[{i}] needs a 'name'")
        location = str(item.get("path") or item.get("uri") or "")
        size = item.get("size")
        if size is None and location and (Path(path).parent / location).is_file():
            size = (Path(path).parent / location).stat().st_size
        if size is not None and (not isinstance(size, int) or size < 0):
            raise PlacementError(f"{path}: adapters[{i}] ({item['name']}): size must be a whole number of bytes")
        specs.append(AdapterSpec(item["name"], size or 0, location))
    return specs


def read_traffic(path: str) -> dict[str, float]:
    """{adapter: share or count}, or the gateway's /metrics text (requests per adapter)."""
    raw = _load(path)
    if isinstance(raw, str) and "loraplex_gateway_requests_total" in raw:
        counts: dict[str, float] = {}
        for line in raw.splitlines():
            m = re.match(r'loraplex_gateway_requests_total\{(.*)\}\s+(\S+)$', line)
            if not m:
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            for name in labels.get("adapter", "base").split("+"):
                if name not in ("base", ""):  # "": refused before its adapters were known (gateway/metrics.py)
                    counts[name] = counts.get(name, 0.0) + float(m.group(2))
        return counts
    try:
        data = yaml.safe_load(raw) if isinstance(raw, str) else raw
    except yaml.YAMLError as e:
        raise PlacementError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict) or not all(isinstance(v, int | float) for v in data.values()):
        raise PlacementError(f"{path}: expected a mapping of adapter name to share or count, "
                             "or the gateway's /metrics text")
    return {str(k): float(v) for k, v in data.items()}


def run(args: argparse.Namespace) -> int:
    try:
        if not 0 <= args.headroom < 1:
            raise PlacementError(f"--headroom must be in [0, 1), got {args.headroom}")
        adapters = read_adapters(args.adapters)
        shares = read_traffic(args.traffic) if args.traffic else {}
        max_adapters, max_bytes = parse_capacity(args.capacity)
        if max_adapters is not None:
            max_adapters = max(1, math.floor(max_adapters * (1 - args.headroom)))
        if max_bytes is not None:
            max_bytes = math.floor(max_bytes * (1 - args.headroom))
        result = plan(adapters, shares, args.workers, max_adapters, max_bytes)
    except PlacementError as e:
        print(f"loraplex plan: {e}", file=sys.stderr)
        return 2
    fragment = {
        "adapters": [{"name": a.name, "path": a.path} for a in adapters],
        "shards": [{"name": s.name, "adapters": list(s.adapters), "replicas": s.replicas} for s in result.shards],
    }
    out = {"loraplex": fragment} if args.format == "helm-values" else fragment
    print(yaml.safe_dump(out, sort_keys=False), end="")
    cap = f"{max_adapters} adapters" if max_adapters is not None else f"{max_bytes} bytes"
    print(f"# {len(adapters)} adapters on {args.workers} workers of {cap}: {len(result.shards)} shard(s)",
          file=sys.stderr)
    for s in result.shards:
        print(f"#   {s.name}: {len(s.adapters)} adapters x {s.replicas} replica(s), expected load "
              f"{s.load_per_replica:.1%} of traffic per replica",
              file=sys.stderr)
    hottest = sorted(result.copies, key=lambda n: -result.copies[n])[:5]
    print(f"# most copies: {', '.join(f'{n} x{result.copies[n]}' for n in hottest)}", file=sys.stderr)
    print(f"# load per worker max/mean = {result.max_over_mean:.3f} (1.000 is perfectly even)", file=sys.stderr)
    for w in result.warnings:
        print(f"# warning: {w}", file=sys.stderr)
    return 0


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("plan", help="place adapters on workers from traffic shares: shards and replicas")
    p.add_argument("--adapters", required=True, metavar="FILE",
                   help="YAML/JSON list of {name, path|uri, size}, or a loraplex config")
    p.add_argument("--traffic", metavar="FILE",
                   help="YAML/JSON {adapter: share or count}, or the gateway's /metrics text (default: even)")
    p.add_argument("--workers", type=positive_int, required=True, metavar="N")
    p.add_argument("--capacity", required=True, metavar="C",
                   help="adapters per worker (16) or bytes per worker (512MiB, 2GB)")
    p.add_argument("--headroom", type=float, default=0.0, metavar="H",
                   help="fraction of each worker's capacity to leave free (default 0)")
    p.add_argument("--format", choices=["config", "helm-values"], default="config",
                   help="a loraplex config fragment, or Helm values")
    p.set_defaults(handler=run)
