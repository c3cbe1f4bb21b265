"""Several hosts on this one machine (network namespaces), and what runs on them: a Ray node on each,
a Redis Cluster, an S3-compatible server, `loraplex serve` joining them (topology.py), for the
multi-node test (tests/cluster) and `loraplex bench-cluster` (bench.py). Needs root and iproute2."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
