"""The placement planner: properties over generated inputs (hypothesis), the Zipf case
the issue names, and `loraplex plan` as users call it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.cli.plan import parse_capacity
from gateway.policy.placement import AdapterSpec, PlacementError, plan, zipf_shares


def names(n: int) -> list[str]:
    return [f"a{i:03d}" for i in range(n)]


@st.composite
def problems(draw):
    n = draw(st.integers(1, 40))
    workers = draw(st.integers(1, 10))
    cap = draw(st.integers(max(1, -(-n // workers)), n))  # always feasible
    weights = draw(st.lists(st.floats(0, 100, allow_nan=False), min_size=n, max_size=n))
    return names(n), workers, cap, dict(zip(names(n), weights))


def check(result, adapters, workers, cap) -> None:
    placed = [a for s in result.shards for _ in range(s.replicas) for a in s.adapters]
    assert set(placed) == set(adapters)  # every adapter placed
    assert sum(s.replicas for s in result.shards) == workers
    # capacity, no duplicates
    assert all(len(s.adapters) <= cap and len(set(s.adapters)) == len(s.adapters) for s in result.shards)
    for name in adapters:  # copies are on distinct workers, and counted right
        assert sum(s.replicas for s in result.shards if name in s.adapters) == result.copies[name]
    assert sum(result.worker_loads) == pytest.approx(1.0)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_every_adapter_placed_within_capacity_deterministically(problem) -> None:
    adapters, workers, cap, shares = problem
    specs = [AdapterSpec(n) for n in adapters]
    result = plan(specs, shares, workers, max_adapters=cap)
    check(result, adapters, workers, cap)
    assert plan(specs, shares, workers, max_adapters=cap) == result
    if workers >= 2 and workers * cap >= 2 * len(adapters):  # room for redundancy: no adapter on one worker only
        assert min(result.copies.values()) >= 2 and not result.warnings
    hottest = max(adapters, key=lambda n: (shares[n], n))
    if workers >= 3 and 2 <= cap < len(adapters) and result.copies[hottest] >= 2:  # sets can differ
        assert len([s for s in result.shards if hottest in s.adapters]) >= 2  # the hot adapter is on several shards


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 30), st.integers(1, 8), st.data())
def test_byte_capacity_is_never_exceeded(n, workers, data) -> None:
    sizes = data.draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    max_bytes = data.draw(st.integers(max(max(sizes), -(-sum(sizes) // workers)) + 1000, sum(sizes) + 1000))
    specs = [AdapterSpec(name, size) for name, size in zip(names(n), sizes)]
    try:
        result = plan(specs, {}, workers, max_bytes=max_bytes)
    except PlacementError as e:  # first-fit can miss a tight packing; it must say so, not overfill
        assert "could not place" in str(e)
        return
    size = dict(zip(names(n), sizes))
    assert all(sum(size[a] for a in s.adapters) <= max_bytes for s in result.shards)
    assert {a for s in result.shards for a in s.adapters} == set(names(n))


def test_zipf_over_64_adapters_on_8_workers_of_16_is_even_and_redundant() -> None:
    adapters = names(64)
    result = plan([AdapterSpec(n) for n in adapters], zipf_shares(adapters, 1.1), 8, max_adapters=16)
    check(result, adapters, 8, 16)
    assert result.max_over_mean <= 1.25
    assert min(result.copies.values()) == 2
    for hot in adapters[:8]:
        assert len([s for s in result.shards if hot in s.adapters]) == 2  # on two distinct shards


def test_inputs_that_cannot_fit_say_why() -> None:
    with pytest.raises(PlacementError, match="10 adapters do not fit on 2 workers of 4: 8 slots"):
        plan([AdapterSpec(n) for n in names(10)], {}, 2, max_adapters=4)
    with pytest.raises(PlacementError, match="larger than a worker's capacity"):
        plan([AdapterSpec("big", 5000)], {}, 2, max_bytes=4000)
    with pytest.raises(PlacementError, match="not in the adapter list: zz"):
        plan([AdapterSpec("a")], {"zz": 1.0}, 1, max_adapters=1)
    assert parse_capacity("16") == (16, None) and parse_capacity("2GiB") == (None, 2 * 2**30)
    with pytest.raises(PlacementError, match="capacity must be"):
        parse_capacity("lots")


def test_the_plan_command_writes_config_or_helm_values(tmp_path) -> None:
    adapters = names(12)
    listing = [{"name": n, "uri": f"s3://bucket/{n}.gguf", "size": 1000} for n in adapters]
    (tmp_path / "adapters.yaml").write_text(yaml.safe_dump(listing))
    series = 'loraplex_gateway_requests_total{{adapter="{}",endpoint="chat",status="200",tenant="t"}} {}.0'
    metrics = "\n".join(series.format(n, 100 // (i + 1)) for i, n in enumerate(adapters))
    (tmp_path / "metrics.txt").write_text(f"# TYPE loraplex_gateway_requests_total counter\n{metrics}\n")
    base = [sys.executable, "-m", "gateway.cli", "plan", "--adapters", str(tmp_path / "adapters.yaml"),
            "--workers", "4", "--capacity", "8"]
    done = subprocess.run([*base, "--traffic", str(tmp_path / "metrics.txt")], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    fragment = yaml.safe_load(done.stdout)
    assert {a for s in fragment["shards"] for a in s["adapters"]} == set(adapters)
    assert "max/mean" in done.stderr and fragment["adapters"][0]["path"] == "s3://bucket/a000.gguf"
    helm = subprocess.run([*base, "--format", "helm-values", "--headroom", "0.25"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert helm.returncode == 0
    assert all(len(s["adapters"]) <= 6 for s in yaml.safe_load(helm.stdout)["loraplex"]["shards"])
    full = subprocess.run([*base[:-4], "--workers", "1", "--capacity", "8"], capture_output=True, text=True, timeout=60,
                          check=False)
    assert full.returncode == 2 and "12 adapters do not fit on 1 workers of 8" in full.stderr
