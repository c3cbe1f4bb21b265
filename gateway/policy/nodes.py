"""Which Ray node each shard replica prefers (pure, Ray-free): a shard's replicas on distinct
nodes where there are enough of them, so that losing a node loses at most one replica of a
shard; worker nodes before the head (losing the head loses the whole cluster anyway, and it
runs Ray's own services); the cluster's replicas balanced over its nodes; and on a machine of
one node, every replica on it.

Every replica is its own Serve deployment (gateway/serve.py), so Serve's own spreading
(`max_replicas_per_node`, per deployment) cannot see a shard's replicas together: the choice
is made here, once, at deploy time, from the nodes alive then, and given to Ray as a soft
preference (gateway/serve.py: a label selector on the node's id, falling back to any node
that fits). A replica restarted after its node died goes wherever it fits; a node that joins
later gets replicas only from the next deploy.

A shard's `node_labels` (Ray's label selector syntax: `value`, `!value`, `in(a, b)`,
`!in(a, b)`) are a hard constraint: its replicas only go to nodes whose labels match.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id

_VALUE = r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?"  # Ray's label value (Kubernetes' syntax)
_SELECTOR = re.compile(rf"!?({_VALUE}|in\({_VALUE}(, ?{_VALUE})*\))")
_KEY = re.compile(rf"([A-Za-z0-9]([A-Za-z0-9.-]{{0,251}}[A-Za-z0-9])?/)?{_VALUE}")


@dataclass(frozen=True)
class Node:
    node_id: str
    resources: Mapping[str, float]  # the node's totals: CPU, GPU, custom resources
    labels: Mapping[str, str] = field(default_factory=dict)
    is_head: bool = False


@dataclass(frozen=True)
class ReplicaDemand:
    """What one replica of a shard needs of a node."""

    shard: str
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    node_labels: Mapping[str, str] = field(default_factory=dict)


def selector_error(selector: Mapping[str, str]) -> str | None:
    """Why `selector` is not a label selector Ray takes, or None."""
    for key, value in selector.items():
        if not _KEY.fullmatch(key):
            return f"label key {key!r} is not a label name (an optional DNS prefix and '/', then up to 63 of [A-Za-z0-9._-])"
        if not _SELECTOR.fullmatch(value):
            return f"label selector {key}: {value!r} is not one of value, !value, in(a, b), !in(a, b)"
    return None


def matches(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    """Whether a node with `labels` satisfies `selector`, as Ray reads it."""
    for key, condition in selector.items():
        is_negated = condition.startswith("!")
        condition = condition.removeprefix("!")
        values = [v.strip() for v in condition[3:-1].split(",")] if condition.startswith("in(") else [condition]
        if (labels.get(key) in values) == is_negated:
            return False
    return True


def _fits(node: Node, demand: ReplicaDemand) -> bool:
    return (node.resources.get("CPU", 0.0) >= demand.num_cpus and node.resources.get("GPU", 0.0) >= demand.num_gpus
            and matches(node.labels, demand.node_labels))


def spread(replicas: Sequence[ReplicaDemand], nodes: Sequence[Node]) -> list[str | None]:
    """The node each replica (in order) prefers, or None where no node fits it (Ray then
    places it, or keeps it pending until one joins). Each goes to a node that fits it and
    holds no replica of its shard yet where there is one, then to one with room left for it,
    then to a worker node rather than the head, then to the one holding the fewest replicas;
    ties by node id, so the same cluster gives the same answer."""
    ordered = sorted(nodes, key=lambda n: n.node_id)
    num_replicas = {n.node_id: 0 for n in ordered}
    used = {n.node_id: {"CPU": 0.0, "GPU": 0.0} for n in ordered}
    shards_on = {n.node_id: set[str]() for n in ordered}
    chosen: list[str | None] = []
    for demand in replicas:
        candidates = [n for n in ordered if _fits(n, demand)]
        if not candidates:
            chosen.append(None)
            continue

        def rank(node: Node, demand: ReplicaDemand = demand) -> tuple[bool, bool, bool, int]:
            has_room = all(used[node.node_id][r] + need <= node.resources.get(r, 0.0)
                           for r, need in (("CPU", demand.num_cpus), ("GPU", demand.num_gpus)))
            return demand.shard in shards_on[node.node_id], not has_room, node.is_head, num_replicas[node.node_id]

        best = min(candidates, key=rank)  # min keeps the first of equals: the lowest node id
        num_replicas[best.node_id] += 1
        used[best.node_id]["CPU"] += demand.num_cpus
        used[best.node_id]["GPU"] += demand.num_gpus
        shards_on[best.node_id].add(demand.shard)
        chosen.append(best.node_id)
    return chosen


def node_options(node_id: str | None, node_labels: Mapping[str, str]) -> dict[str, object]:
    """Ray actor options for a replica that prefers `node_id` and needs `node_labels`. Serve takes
    no scheduling strategy in ray_actor_options, but takes Ray's label selectors: one on the node's
    id label, falling back to any node with `node_labels` (Ray falls back when that node is gone
    or full), is a soft node affinity."""
    if node_id is None:
        return {"label_selector": dict(node_labels)} if node_labels else {}
    return {"label_selector": {NODE_ID_LABEL: node_id, **node_labels}, "fallback_strategy": [{"label_selector": dict(node_labels)}]}
