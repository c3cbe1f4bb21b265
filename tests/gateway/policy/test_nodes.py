"""Which node each shard replica prefers (gateway/policy/nodes.py): a shard's replicas on
distinct nodes while there are enough, balanced over the cluster, all on a lone node, and only
on nodes that fit them."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from gateway.policy.nodes import Node, ReplicaDemand, matches, selector_error, spread


def nodes(count: int, cpus: float = 8) -> list[Node]:
    return [Node(f"node{i}", {"CPU": cpus}) for i in range(count)]


def replicas(**counts: int) -> list[ReplicaDemand]:
    return [ReplicaDemand(shard) for shard, count in counts.items() for _ in range(count)]


def test_on_one_node_every_replica_goes_there() -> None:
    assert spread(replicas(a=3, b=2), nodes(1)) == ["node0"] * 5


@pytest.mark.parametrize(("num_nodes", "counts"), [(2, {"a": 2, "b": 2}), (3, {"a": 3, "b": 2, "c": 1}), (4, {"a": 2, "b": 3})])
def test_losing_a_node_loses_at_most_one_replica_of_a_shard_when_there_are_enough_nodes(num_nodes, counts) -> None:
    demands = replicas(**counts)
    chosen = spread(demands, nodes(num_nodes))
    per_node_and_shard = Counter(zip(chosen, (d.shard for d in demands)))
    assert max(per_node_and_shard.values()) == 1
    per_node = Counter(chosen)
    assert max(per_node.values()) - min(per_node.values()) <= 1  # the cluster balanced too


def test_with_fewer_nodes_than_replicas_a_shard_is_spread_as_evenly_as_it_can_be() -> None:
    chosen = spread(replicas(a=5), nodes(2))
    assert sorted(Counter(chosen).values()) == [2, 3]


def test_the_answer_does_not_depend_on_the_order_nodes_are_listed_in() -> None:
    cluster = nodes(3)
    shuffled = cluster[:]
    random.Random(0).shuffle(shuffled)
    demands = replicas(a=2, b=3, c=1)
    assert spread(demands, cluster) == spread(demands, shuffled)


def test_a_replica_goes_only_to_a_node_with_its_resources_and_none_when_no_node_has_them() -> None:
    cluster = [Node("cpu", {"CPU": 16}), Node("gpu0", {"CPU": 8, "GPU": 1}), Node("gpu1", {"CPU": 8, "GPU": 1})]
    demands = [ReplicaDemand("g", num_gpus=1), ReplicaDemand("g", num_gpus=1), ReplicaDemand("c"),
               ReplicaDemand("big", num_cpus=32)]
    assert spread(demands, cluster) == ["gpu0", "gpu1", "cpu", None]


def test_worker_nodes_are_preferred_to_the_head_and_the_head_takes_what_they_cannot() -> None:
    cluster = [Node("head", {"CPU": 8}, is_head=True), *nodes(2)]
    assert spread(replicas(a=2, b=2), cluster) == ["node0", "node1", "node0", "node1"]
    assert spread(replicas(a=3), cluster) == ["node0", "node1", "head"]  # distinct nodes first
    assert spread(replicas(a=2), [Node("head", {"CPU": 8}, is_head=True)]) == ["head", "head"]


def test_a_node_with_room_is_preferred_to_a_full_one() -> None:
    cluster = [Node("small", {"CPU": 1}), Node("large", {"CPU": 4})]
    assert spread(replicas(a=1, b=1, c=1), cluster) == ["large", "small", "large"]


def test_node_labels_are_a_hard_constraint_and_the_spread_is_among_the_nodes_with_them() -> None:
    cluster = [Node("a0", {"CPU": 8}, {"pool": "a100"}), Node("a1", {"CPU": 8}, {"pool": "a100"}),
               Node("t0", {"CPU": 8}, {"pool": "t4"})]
    demands = [ReplicaDemand("s", node_labels={"pool": "a100"})] * 3
    assert sorted(spread(demands, cluster)) == ["a0", "a0", "a1"]
    assert spread([ReplicaDemand("s", node_labels={"pool": "h100"})], cluster) == [None]


@pytest.mark.parametrize(("labels", "selector", "expected"), [
    ({"zone": "a"}, {"zone": "a"}, True),
    ({"zone": "a"}, {"zone": "b"}, False),
    ({}, {"zone": "a"}, False),
    ({"zone": "a"}, {"zone": "!a"}, False),
    ({}, {"zone": "!a"}, True),
    ({"zone": "b"}, {"zone": "in(a, b)"}, True),
    ({"zone": "c"}, {"zone": "in(a,b)"}, False),
    ({"zone": "c"}, {"zone": "!in(a, b)"}, True),
    ({"zone": "a", "gpu": "h100"}, {"zone": "a", "gpu": "in(h100)"}, True),
])
def test_label_selectors_match_as_ray_reads_them(labels, selector, expected) -> None:
    assert matches(labels, selector) is expected


@pytest.mark.parametrize("selector", [{"zone": "a"}, {"ray.io/accelerator-type": "H100"}, {"zone": "!in(a, b-c)"}])
def test_ray_label_selectors_are_taken(selector) -> None:
    assert selector_error(selector) is None


@pytest.mark.parametrize(("selector", "fragment"), [
    ({"zone": "a b"}, "'a b'"), ({"zone": ""}, "''"), ({"zone": "in()"}, "in()"), ({"bad key!": "a"}, "bad key!"),
])
def test_bad_label_selectors_are_named(selector, fragment) -> None:
    error = selector_error(selector)
    assert error is not None and fragment in error


def test_every_shard_of_a_small_cluster_keeps_a_replica_after_any_one_node_is_lost() -> None:
    demands = replicas(a=2, b=2, c=3)
    chosen = spread(demands, nodes(3))
    for lost in ("node0", "node1", "node2"):
        left = Counter(d.shard for d, node in zip(demands, chosen) if node != lost)
        assert all(left[shard] >= count - 1 for shard, count in {"a": 2, "b": 2, "c": 3}.items())
