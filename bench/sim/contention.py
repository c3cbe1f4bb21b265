"""Replicas that share their machine's cores with the serving path (`loraplex serve` on one machine, as
`bench.sim.validate` runs it): a pass runs slower while more engines and more serving work want the cores than
there are. The serving path's work (HTTP, the gateway, Ray's calls and streams, Redis, the load tester) is CPU
time per request, spent over the request's life (from its arrival to its last token: `window_s`, measured), so it
is spread over the requests that arrived in the last `window_s`; each engine wants one core (its
one torch thread, as calibrated). A profile calibrated with every replica's engine busy on the same cores is the
cost with no serving work beside them, so a pass takes max(1, (engines + serving cores) / cores) of it. The part
of the serving work done in a replica's own process (its Ray calls and streams, prefix lookups and stores: Python
threads beside the engine's) holds the interpreter lock the engine's Python needs between its kernels: while that
part takes a share g of the process's time (its requests' in the window), the replica's passes take 1 / (1 - g)
longer again, whatever cores are free."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

WINDOW_S = 2.0  # a request's life where none was measured: its serving work is spread over this


class Stepping(Protocol):
    num_steps: int  # > 0: a step under way


class SharedCores:
    def __init__(self, cores: int, serving_cpu_request_s: float, replicas: Sequence[Stepping],
                 replica_cpu_request_s: float = 0.0, window_s: float = WINDOW_S) -> None:
        self.cores, self.per_request_s, self.replicas, self.window_s = cores, serving_cpu_request_s, replicas, window_s
        self.in_replica_s = replica_cpu_request_s  # of the serving CPU a request, what its replica's process spends
        self._arrivals: deque[float] = deque()
        self._at_replica: dict[int, deque[float]] = {}

    def arrived(self, now_s: float) -> None:
        self._arrivals.append(now_s)

    def reached(self, now_s: float, replica: int) -> None:
        """A request reached `replica` (its process's share of the serving work starts there)."""
        self._at_replica.setdefault(replica, deque()).append(now_s)

    def factor(self, now_s: float, replica: int = -1) -> float:
        """How much slower than its profile a pass starting now runs on `replica` (not counted as stepping)."""
        serving_cores = self.per_request_s * _recent(self._arrivals, now_s, self.window_s) / self.window_s
        engines = 1 + sum(1 for r in self.replicas if r.num_steps > 0)
        cores = max(1.0, (engines + serving_cores) / self.cores)
        at_replica = self._at_replica.get(replica)
        held = min(MAX_HELD, self.in_replica_s * _recent(at_replica, now_s, self.window_s) / self.window_s) if at_replica else 0.0
        return cores / (1 - held)


MAX_HELD = 0.5  # the interpreter lock's share held by a replica's other threads, at most (the engine's Python gets its turn)


def _recent(times: deque[float], now_s: float, window_s: float) -> int:
    """How many of `times` are within the last `window_s` (older ones dropped)."""
    while times and times[0] <= now_s - window_s:
        times.popleft()
    return len(times)
