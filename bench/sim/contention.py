"""Replicas that share their machine's cores with the serving path (`loraplex serve` on one machine, as
`bench.sim.validate` runs it): a pass runs slower while more engines and more serving work want the cores than
there are. The serving path's work (HTTP, the gateway, Ray's calls and streams, Redis, the load tester) is CPU
time per request, spread over the requests that arrived in the last `WINDOW_S`; each engine wants one core (its
one torch thread, as calibrated). A profile calibrated with every replica's engine busy on the same cores is the
cost with no serving work beside them, so a pass takes max(1, (engines + serving cores) / cores) of it."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

WINDOW_S = 2.0  # about a request's life here (its TTFT and its tokens): its serving work is spread over this


class Stepping(Protocol):
    num_steps: int  # > 0: a step under way


class SharedCores:
    def __init__(self, cores: int, serving_cpu_request_s: float, replicas: Sequence[Stepping]) -> None:
        self.cores, self.per_request_s, self.replicas = cores, serving_cpu_request_s, replicas
        self._arrivals: deque[float] = deque()

    def arrived(self, now_s: float) -> None:
        self._arrivals.append(now_s)

    def factor(self, now_s: float) -> float:
        """How much slower than its profile a pass starting now runs, on a replica not counted as stepping."""
        while self._arrivals and self._arrivals[0] <= now_s - WINDOW_S:
            self._arrivals.popleft()
        serving_cores = self.per_request_s * len(self._arrivals) / WINDOW_S
        engines = 1 + sum(1 for r in self.replicas if r.num_steps > 0)
        return max(1.0, (engines + serving_cores) / self.cores)
