"""Closed-loop users in a simulated fleet (a scenario's `sim.users`, or `load: {mode: closed}`): each
user sends a request, and once it has ended (answered, refused or failed) pauses `think_s` and sends
the next, from its group's `from_s` until its `until_s`, as the load tester's closed loop and
bench/autoscale_burst.py's light client do. Its requests' indices start above every open-loop
request's (`max_requests`), so the fleet tells them apart."""

from __future__ import annotations

import random
from collections.abc import Callable

from bench.sim.workload import FleetScenario, SimRequest, Users
from gateway.loadtest.scenario import Scenario

REFUSED_PAUSE_S = 0.05  # a refused request's round trip: the user's next one is not sent at the same instant


class ClosedLoop:
    def __init__(self, fleet: FleetScenario, scenario: Scenario, send: Callable[[SimRequest], None], hop_s: float = 0.0) -> None:
        """`send(request)`: the request arrives at its `at_s`; `hop_s`: a user's next request reaches the fleet so
        long after its last ended (its last token's way back, the next one's way in: the profile's hops)."""
        self.groups, self.scenario, self.send, self.hop_s = fleet.sim.users, scenario, send, hop_s
        self.rng = random.Random(f"{scenario.seed}-users")
        self.next_index = scenario.max_requests
        self.group_of: dict[int, int] = {}  # a request in flight -> its user's group
        self.last_end_s: list[float | None] = [None] * len(self.groups)  # each group's last request's end
        self.num_sent = [0] * len(self.groups)
        for g, group in enumerate(self.groups):
            for _ in range(group.num_users):
                self._send(g, group.from_s)

    def _until_s(self, group: Users) -> float:
        return self.scenario.duration_s if group.until_s is None else min(group.until_s, self.scenario.duration_s)

    def _send(self, g: int, at_s: float) -> None:
        group, scenario = self.groups[g], self.scenario
        if at_s >= self._until_s(group):
            return
        prompt = group.prompt_tokens or scenario.prompts.length
        output = group.output_tokens or scenario.output_tokens
        tenant = group.tenant or scenario.tenants[0].name
        request = SimRequest(self.next_index, at_s, tenant, group.adapter, -1, 0, self.rng.randint(prompt.min, prompt.max),
                             self.rng.randint(output.min, output.max))
        self.group_of[request.index] = g
        self.next_index += 1
        self.num_sent[g] += 1
        self.send(request)

    def ended(self, request: SimRequest, outcome: str, now_s: float) -> None:
        """A request has ended: if a user's, its next one after the pause."""
        g = self.group_of.pop(request.index, None)
        if g is None:
            return
        self.last_end_s[g] = now_s
        think_s = self.groups[g].think_s if outcome == "completed" else max(self.groups[g].think_s, REFUSED_PAUSE_S)
        self._send(g, now_s + self.hop_s + think_s)
