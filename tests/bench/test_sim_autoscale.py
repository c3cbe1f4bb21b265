"""bench/sim's scaled shards: a policy's count becomes replicas that start (after the profile's
delays) and drain; ours is the production decision; fixed never changes; `--autoscale` prints the
comparison, and a duration within the warm-up is a clear error."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import yaml

import bench.sim.autoscalers as autoscalers
import gateway.policy.autoscale as autoscale
from bench.sim.elastic import fewest, run_fixed, run_scaled, scaled_placement
from bench.sim.oracle import Oracle, rate_at, run_oracle
from bench.sim.profile import CostProfile
from bench.sim.report import SLO
from bench.sim.workload import FleetScenario, parse_fleet_scenario
from gateway.cli import main as cli_main
from gateway.policy.autoscale import AutoscalingSettings
from worker.contract.spec import EngineConfig

PROFILE = CostProfile("test", False, step_overhead_s=0.01, prompt_token_s=0.0005, decode_seq_s=0.001,
                      engine=EngineConfig(num_seq_slots=4, slot_len=1024, max_step_tokens=512, prefill_while_decoding=64,
                                          decode_stall=None, max_waiting=16),
                      replica_start_s=4.0, adapter_fetch_s=0.1)
SLO_ = SLO(1.0, 0.1)
SCENARIO = {
    "name": "burst", "seed": 3, "duration_s": 150, "warmup_s": 5, "max_requests": 100_000,
    "load": {"rate_rps": 4}, "phases": [{"at_s": 30, "rate_rps": 30}, {"at_s": 60, "rate_rps": 4}],
    "tenants": [{"name": "a", "weight": 1}], "adapters": {"names": ["base"], "zipf_s": 1.1},
    "prompts": {"kind": "random", "length": {"min": 16, "max": 64}}, "output_tokens": {"min": 32, "max": 64},
    "sim": {"num_adapters": 6, "max_adapters_per_replica": 4, "itl_s": 0.1,
            "autoscaling": {"policy": {"min_replicas": 1, "max_replicas": 6, "upscale_delay_s": 1.0, "downscale_delay_s": 10.0,
                                       "lead_s": 0.0}}},
}


def fleet() -> FleetScenario:
    return parse_fleet_scenario(SCENARIO)


def counts(policy: str) -> tuple[dict, list[tuple[float, int]]]:
    row, scaler = run_scaled(fleet(), policy, PROFILE, SLO_)
    return row, scaler.figures.timeline


def test_ours_is_the_production_decision() -> None:
    assert autoscalers.decide is autoscale.decide


def test_the_shards_and_their_replicas() -> None:
    placement, shards, initial = scaled_placement(fleet())
    assert len(shards) == 3 and initial == dict.fromkeys(shards, 1)  # 6 adapters x 2 copies, 4 a replica
    assert all(len(indices) == 6 for indices in shards.values())  # every replica a shard may have, with its pins
    assert all(len({placement.pins[i] for i in indices}) == 1 for indices in shards.values())


def test_ours_scales_up_under_a_burst_and_back_down_after() -> None:
    row, timeline = counts("ours")
    before = [n for t, n in timeline if t < 30]
    during = [n for t, n in timeline if 40 <= t < 60]
    after = [n for t, n in timeline if t >= 140]
    assert set(before) == {3} and max(during) > 3 and after[-1] < max(during)
    assert row["failed"] == 0 and row["peak_replicas"] == max(n for t, n in timeline if t >= 5)
    # costing is what it says: more than 2 replicas' time, less than the peak's
    assert 3 * 145 < row["replica_s"] < row["peak_replicas"] * 145


def test_a_replica_serves_only_after_its_start_and_drains_what_it_holds() -> None:
    slow = replace(PROFILE, replica_start_s=200.0)  # no replica asked for ever starts within the run
    row, scaler = run_scaled(fleet(), "ours", slow, SLO_)
    assert scaler.figures.num_started > 0
    assert all(len(scaler.fleet.replicas[i].running) == 0 and scaler.fleet.replicas[i].stats.num_steps == 0
               for shard in scaler.shards for i in shard.indices[1:])  # only the first of each ever stepped
    fast_row, fast = run_scaled(fleet(), "ours", PROFILE, SLO_)
    assert fast.figures.num_drained > 0 and fast_row["failed"] == 0  # drained replicas finished what they held
    total = sum(fast_row["tenants"][t]["measured"] for t in fast_row["tenants"])
    assert total > 0 and fast_row["refused_busy"] <= row["refused_busy"]


def test_fixed_never_changes() -> None:
    row, timeline = counts("fixed")
    assert {n for _, n in timeline} == {3} and row["replica_s"] == pytest.approx(3 * 145)
    fixed = run_fixed(fleet(), 3, PROFILE, SLO_)
    assert fixed["replica_s"] == pytest.approx(3 * 145) and fixed["peak_replicas"] == 3


@pytest.mark.parametrize("policy", ["serve-default", "knative", "queue-depth"])
def test_the_peer_policies_scale_within_the_bounds(policy: str) -> None:
    row, timeline = counts(policy)
    assert all(3 <= n <= 18 for _, n in timeline) and row["failed"] == 0


def test_same_seed_same_figures() -> None:
    assert counts("ours") == counts("ours")


def test_the_command_compares_the_policies_and_refuses_a_duration_within_the_warm_up(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("bench.sim.cli.load_profile", lambda _: PROFILE)
    path = tmp_path / "burst.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    assert cli_main(["simulate", "--scenario", str(path), "--replicas", "6", "--autoscale", "ours,fixed", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["policy"] for r in rows][:2] == ["ours", "fixed"] and rows[-1]["vs_fixed"] == pytest.approx(1.0)
    assert cli_main(["simulate", "--scenario", str(path), "--autoscale", "ours,sometimes"]) == 2
    assert "unknown scaling policy 'sometimes'" in capsys.readouterr().err
    for duration in ("5", "3"):
        assert cli_main(["simulate", "--scenario", str(path), "--duration-s", duration]) == 2
        err = capsys.readouterr().err
        assert "must be longer than the scenario's warm-up (5 s)" in err and "Traceback" not in err


def test_fewest_finds_the_first_count_that_meets_and_none_past_the_most() -> None:
    asked: list[int] = []

    def meets(n: int) -> bool:
        asked.append(n)
        return n >= 7

    assert fewest(meets, 1, 20) == 7 and len(asked) <= 6  # a binary search, not a walk
    assert fewest(meets, 7, 7) == 7 and fewest(meets, 1, 6) is None


def test_queue_depth_asks_for_the_larger_of_its_metrics_and_keeps_its_highest_ask_for_its_window() -> None:
    policy = autoscalers.QueueDepth(autoscale.AutoscalingSettings(min_replicas=1, max_replicas=16))

    def sample(current: int, running: int, waiting: int) -> autoscalers.ShardSample:
        load = autoscale.ShardLoad(num_ready=current, num_starting=0, num_slots=64 * current, num_running=running,
                                   num_waiting=waiting)
        return autoscalers.ShardSample(load, current, 64)

    assert policy.decide(sample(2, 128, 60), 0.0) == 6  # the queue asks 12 (5 a replica); up by max(4, 100%) a sync
    assert policy.decide(sample(6, 128, 60), 5.0) == 6  # between two syncs: nothing
    assert policy.decide(sample(6, 300, 0), 15.0) == 6  # 300 running at 51.2 a replica: within the tolerance of 6
    counts = {t: policy.decide(sample(6, 30, 0), t) for t in range(30, 331, 15)}  # 30 running asks for 1
    assert set(counts[t] for t in range(30, 301, 15)) == {6} and counts[315] == counts[330] == 1


def test_the_oracles_rate_is_the_scenarios() -> None:
    rate = rate_at(fleet().scenario)  # 4 req/s, 30 from 30 s to 60 s
    assert [rate(t) for t in (0.0, 29.9, 30.0, 59.9, 60.0)] == [4, 4, 30, 30, 4]
    own = parse_fleet_scenario({**SCENARIO, "tenants": [{"name": "a", "weight": 1}, {"name": "b", "rate_rps": 2}],
                                "phases": [{"at_s": 10, "rate_rps": 8, "tenant": "b"}]}).scenario
    assert [rate_at(own)(t) for t in (0.0, 10.0)] == [6, 12]  # a tenant's own rate beside the shared one


def test_the_oracle_asks_a_start_ahead_and_lets_go_when_the_rate_has_gone() -> None:
    settings = AutoscalingSettings(min_replicas=1, max_replicas=4)
    oracle = Oracle(settings, rate_at(fleet().scenario), num_shards=3, capacity_rps=2.0, lead_s=5.0)
    sample = autoscalers.ShardSample(autoscale.ShardLoad(1, 0, 4, 0, 0), current=1, slots_per_replica=4)
    counts = {t: oracle.decide(sample, t) for t in (0.0, 24.9, 25.0, 59.9, 60.0)}
    assert counts == {0.0: 1, 24.9: 1, 25.0: 4, 59.9: 4, 60.0: 1}  # 30 req/s / 3 shards / 2 = 5: max 4; 4 / 6: min 1
    with pytest.raises(ValueError, match="capacity_rps"):
        Oracle(settings, lambda t: 1.0, 3, 0.0, 5.0)


def test_the_oracle_runs_within_the_bounds() -> None:
    row, scaler = run_oracle(fleet(), 2.0, PROFILE, SLO_)
    assert row["policy"].startswith("oracle") and row["failed"] == 0
    assert all(3 <= n <= 18 for _, n in scaler.figures.timeline) and max(n for _, n in scaler.figures.timeline) > 3
