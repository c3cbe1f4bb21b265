"""bench/sim: the fleet simulator drives the production routing, placement and admission code
in virtual time; its figures are deterministic, every request ends once, and its replica
batches as the engine's scheduler does."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import yaml

import bench.sim.fleet as fleet_module
import bench.sim.replica as replica_module
import bench.sim.routers as routers_module
import gateway.policy.placement as placement
import gateway.policy.routing as routing
import gateway.tenancy.ratelimit as ratelimit
import worker.engine.step_costs as step_costs
from bench.sim.cli import simulate
from bench.sim.fleet import OUTCOMES, Fleet, Placement
from bench.sim.profile import CostProfile, load_profile
from bench.sim.replica import PrefixCache, ReplicaModel, Seq
from bench.sim.routers import ROUTERS
from bench.sim.workload import FleetScenario, SimRequest, parse_fleet_scenario, requests
from gateway.cli import main as cli_main
from tests.helpers import TEST_DEVICE
from worker.contract.spec import EngineConfig
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import SequenceState

PROFILE = CostProfile("test", False, step_overhead_s=0.01, prompt_token_s=0.0005, decode_seq_s=0.001,
                      engine=EngineConfig(num_seq_slots=4, slot_len=1024, max_step_tokens=256, prefill_while_decoding=32,
                                          decode_stall=None, max_waiting=4))


def scenario(rate_rps: float = 20.0, num_adapters: int = 40, duration_s: float = 30.0, kind: str = "shared_prefix",
             prompts: dict | None = None, **sim: object) -> FleetScenario:
    return parse_fleet_scenario({
        "name": "t", "seed": 7, "duration_s": duration_s, "warmup_s": 2, "max_requests": 100_000,
        "load": {"rate_rps": rate_rps}, "phases": [{"at_s": 10, "burst": 30}, {"at_s": 15, "shift": 3}],
        "tenants": [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}],
        "adapters": {"names": ["base"], "zipf_s": 1.1},
        "prompts": {"kind": kind, "num_prefixes": 4, "prefix_tokens": 128, "length": {"min": 8, "max": 64}, **(prompts or {})},
        "output_tokens": {"min": 4, "max": 24}, "chunk_tokens": 32,
        "sim": {"num_adapters": num_adapters, "max_adapters_per_replica": 20, "itl_s": 0.1,
                "tenant_limits": {"b": {"requests_per_min": 120}}, **sim},
    })


@pytest.fixture
def profile(monkeypatch: pytest.MonkeyPatch) -> CostProfile:
    monkeypatch.setattr("bench.sim.cli.load_profile", lambda _: PROFILE)
    return PROFILE


def test_the_production_objects_are_used_unchanged() -> None:
    assert routers_module.candidates is routing.candidates
    assert routers_module.choose is routing.choose
    assert routers_module.RecentLoad is routing.RecentLoad
    assert routers_module.ReplicaView is routing.ReplicaView
    assert routers_module.affinity_key is routing.affinity_key
    assert routers_module.RoutingSettings is routing.RoutingSettings
    assert fleet_module.plan is placement.plan
    assert fleet_module.zipf_shares is placement.zipf_shares
    assert fleet_module.RateLimiter is ratelimit.RateLimiter
    assert replica_module.StepCosts is step_costs.StepCosts


def test_same_seed_same_figures(profile: CostProfile) -> None:
    fleet = scenario()
    assert simulate(fleet, 6, list(ROUTERS)) == simulate(fleet, 6, list(ROUTERS))


def test_every_request_ends_exactly_once(profile: CostProfile) -> None:
    fleet = scenario(rate_rps=60.0)  # overloaded: 429s and 503s
    num_requests = sum(1 for _ in requests(fleet.scenario))
    rows = simulate(fleet, 4, list(ROUTERS))
    for row in rows:
        assert sum(row[o] for o in OUTCOMES) == num_requests, row["router"]
    ours = rows[0]
    assert ours["completed"] > 0 and ours["refused_rate"] > 0 and ours["refused_busy"] > 0


def test_ours_routes_an_adapter_only_to_the_replica_pinning_it(profile: CostProfile) -> None:
    fleet = scenario(rate_rps=10.0, num_adapters=1)
    only = fleet.scenario.adapters.names[0]
    pinned = Placement((frozenset({only}), frozenset({"other"})), {only: [0], "other": [1]})
    run = Fleet(fleet, fleet.scenario, PROFILE, pinned, "ours")
    record = run.run()
    assert record.outcomes["completed"] > 0
    assert run.replicas[1].stats.num_steps == 0 and run.replicas[0].stats.num_steps > 0
    least = Fleet(fleet, fleet.scenario, PROFILE, pinned, "least-loaded")  # ignores residency: loads the adapter on 1
    least.run()
    assert least.replicas[1].stats.num_steps > 0


def test_more_load_more_time_to_first_token(profile: CostProfile) -> None:
    light, heavy = (simulate(scenario(rate_rps=r, duration_s=20, kind="random"), 6, ["ours"])[0] for r in (5.0, 45.0))
    assert heavy["ttft_p50_s"] > light["ttft_p50_s"] and heavy["util_mean"] > 3 * light["util_mean"]


def test_a_shared_tier_finds_more_prefixes(profile: CostProfile) -> None:
    shared = simulate(scenario(), 6, ["round-robin"])[0]
    own = simulate(scenario(shared_cache=False), 6, ["round-robin"])[0]
    assert shared["prefix_hit_rate"] > own["prefix_hit_rate"] > 0


Steps = list[tuple[int, int]]  # each step's decoding sequences and prompt tokens


def _model_steps(prompts: list[int], max_tokens: list[int], tenants: list[str], multi: bool = False) -> tuple[Steps, list[int]]:
    """The replica model's steps, and the requests in the order they got their first token."""
    profile = replace(PROFILE, engine=replace(PROFILE.engine, max_waiting=len(prompts), is_multi_tenant=multi))
    replica = ReplicaModel(0, profile, PrefixCache(32, True, 0), frozenset())
    seqs = [Seq(SimRequest(i, 0.0, tenant, "base", -1, 0, p, g), 0.0)
            for i, (p, g, tenant) in enumerate(zip(prompts, max_tokens, tenants))]
    for seq in seqs:
        assert replica.offer(seq)
    steps: Steps = []
    end_s = replica.start(0.0)
    while end_s is not None:
        steps += [(replica._num_decode, replica._num_prompt_tokens)] * replica.num_steps
        replica.finish_steps(end_s)
        end_s = replica.start(end_s)
    return steps, sorted(range(len(seqs)), key=lambda i: (seqs[i].first_token_s, i))


def _scheduler_steps(prompts: list[int], max_tokens: list[int], tenants: list[str], multi: bool = False) -> tuple[Steps, list[int]]:
    """worker/engine/scheduler.py's steps for the same requests (costs from the same profile)."""
    config = PROFILE.engine
    scheduler = Scheduler(config.num_seq_slots, config.slot_len, config.max_step_tokens, is_multi_tenant=multi,
                          prefill_while_decoding=config.prefill_while_decoding)
    for i, (p, g, tenant) in enumerate(zip(prompts, max_tokens, tenants)):
        scheduler.add(SequenceState(f"r{i}", list(range(p)), p, p + g, tenant=tenant))
    steps: Steps = []
    firsts: list[tuple[int, int]] = []  # (step, request)
    while scheduler.has_work():
        spans = scheduler.schedule()
        prompt_tokens = sum(span.prompt_tokens for span in spans)
        steps.append((sum(span.length for span in spans) - prompt_tokens, prompt_tokens))
        for span in spans:
            seq = span.seq
            seq.num_computed += span.length
            if span.samples:
                if len(seq.token_ids) == seq.num_prompt_tokens:
                    firsts.append((len(steps), int(seq.request_id[1:])))
                seq.token_ids.append(0)
                if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_len - seq.num_prompt_tokens:
                    scheduler.finish(seq)
    return steps, [i for _, i in sorted(firsts)]


PROMPTS = [300, 20, 90, 5, 200, 64, 33, 150, 7, 400, 60, 12]
MAX_TOKENS = [5, 30, 12, 1, 8, 40, 3, 17, 25, 6, 9, 50]


def test_the_replica_batches_as_the_engine_scheduler_does() -> None:
    tenants = ["t"] * len(PROMPTS)
    assert _model_steps(PROMPTS, MAX_TOKENS, tenants) == _scheduler_steps(PROMPTS, MAX_TOKENS, tenants)


@pytest.mark.parametrize("multi", [False, True])
def test_the_replica_shares_between_tenants_as_the_engine_scheduler_does(multi: bool) -> None:
    """A tenant's backlog of long prompts arrived first; another's short ones: the second tenant is
    served by least attained service and the reserved slot, step for step as the scheduler does."""
    tenants = ["flood"] * 7 + ["quiet", "other", "quiet", "flood", "other"]
    model = _model_steps(PROMPTS, MAX_TOKENS, tenants, multi)
    assert model == _scheduler_steps(PROMPTS, MAX_TOKENS, tenants, multi)
    fifo = _model_steps(PROMPTS, MAX_TOKENS, ["t"] * len(PROMPTS), multi)[1]
    assert model[1].index(7) < fifo.index(7)  # the quiet tenant's first request starts sooner than in arrival order


def test_profiles_load_and_say_whether_they_were_measured() -> None:
    assert load_profile("cpu-2core").is_measured
    assert not load_profile("gpu-8b-assumed").is_measured


def test_calibrate_fits_the_engine_and_writes_a_profile_simulate_reads(tiny_llama, tmp_path, capsys) -> None:
    out = tmp_path / "tiny.yaml"
    code = cli_main(["calibrate", "--model", str(tiny_llama.path), "--out", str(out), "--adapters", "2", "--rank", "2",
                     "--rounds", "1", "--concurrent", "2", "--threads", "1", "--device", TEST_DEVICE.device])
    assert code == 0
    assert f"wrote {out}" in capsys.readouterr().out
    profile = load_profile(str(out))
    assert profile.name == "tiny" and profile.is_measured
    assert profile.step_overhead_s > 0 and profile.prompt_token_s >= 0 and profile.decode_seq_s >= 0
    assert profile.step_s(64, 4) > profile.step_s(0, 1) > 0
    hp = tiny_llama.spec
    assert profile.kv_bytes_per_token == hp.num_layers * hp.num_kv_heads * (hp.embed_dim // hp.num_heads) * 2 * 4  # K, V in fp32
    assert profile.engine == EngineConfig()
    assert "# Measured by `loraplex calibrate`" in out.read_text() and "1 other engine(s)" in out.read_text()
    contexts = {int(c) for c in re.findall(r"^#\s+0 \+\s+\d+ @\s*(\d+):", out.read_text(), re.MULTILINE)}
    assert min(contexts) < 20 and max(contexts) > 100 and profile.decode_context_s >= 0  # decoders' short and long contexts


def test_the_command_prints_json_and_writes_the_report_with_plots(tmp_path, capsys) -> None:
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump({
        "name": "small", "seed": 3, "duration_s": 40, "warmup_s": 5, "max_requests": 10_000, "load": {"rate_rps": 20},
        "phases": [{"at_s": 20, "rate_rps": 60, "tenant": "loud"}],
        "tenants": [{"name": "a"}, {"name": "loud", "rate_rps": 2}], "adapters": {"names": ["base"], "zipf_s": 1.1},
        "prompts": {"kind": "shared_prefix", "num_prefixes": 4, "prefix_tokens": 128, "length": {"min": 8, "max": 64}},
        "output_tokens": {"min": 4, "max": 24}, "sim": {"num_adapters": 40, "max_adapters_per_replica": 20},
    }))
    out = tmp_path / "report"
    assert cli_main(["simulate", "--scenario", str(path), "--replicas", "4", "--policy", "ours", "--policy", "round-robin",
                     "--l2-fetch-token-s", "0.00001", "--json", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]
    assert [row["router"] for row in rows] == ["ours", "round-robin"]
    assert all(set(row["tenants"]) == {"a", "loud"} and row["fetched_tokens"] > 0 for row in rows)
    assert {p.name for p in out.iterdir()} == {"report.json", "report.md", "ttft_cdf.png", "ttft_over_time.png",
                                               "adapter_loads.png", "replica_utilisation.png", "goodput_per_tenant.png"}
    assert "round-robin" in (out / "report.md").read_text() and f"report in {out}" in captured.err
    assert cli_main(["simulate", "--scenario", str(path), "--replicas", "4", "--policy", "fastest"]) == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err
    assert cli_main(["simulate", "--scenario", str(path), "--replicas", "4", "--eps", "0"]) == 2
    assert "--eps: eps and half_life_s must be > 0" in capsys.readouterr().err


def test_chat_turns_find_their_conversation_and_alora_calls_the_base_kv(profile: CostProfile) -> None:
    """chat: a turn's cached prefix is its conversation's last prompt; alora_pipeline: the aLoRA
    call is sent once its base call has ended and finds the base's KV before its invocation."""
    chat = scenario(kind="chat")
    turns = [r for r in requests(chat.scenario) if r.num_prefix_tokens]
    assert len(turns) > 100 and all(r.stores_tokens == r.num_prompt_tokens for r in turns)
    row = simulate(chat, 6, ["ours"])[0]
    assert 0.3 < row["prefix_hit_rate"] < 1 and row["completed"] + row["refused_rate"] == row["measured"] + \
        sum(1 for r in requests(chat.scenario) if r.at_s < chat.scenario.warmup_s)
    pipeline = scenario(kind="alora_pipeline", prompts={"alora_adapter": "check", "length": {"min": 64, "max": 128}})
    calls = list(requests(pipeline.scenario))
    assert [r.adapter == "check" for r in calls[:6]] == [False, True] * 3 and calls[1].after == 0
    fleet_run = Fleet(pipeline, pipeline.scenario, PROFILE, fleet_module.place(pipeline, 6), "ours")
    sent: dict[int, float] = {}
    ended: dict[int, float] = {}
    arrive, end = fleet_run._arrive, fleet_run._end
    fleet_run._arrive = lambda request: (sent.__setitem__(request.index, fleet_run.now_s), arrive(request))  # type: ignore[method-assign]
    fleet_run._end = lambda request, outcome: (ended.setdefault(request.index, fleet_run.now_s), end(request, outcome))  # type: ignore[method-assign]
    record = fleet_run.run()
    assert sum(record.outcomes[o] for o in OUTCOMES) == len(calls) and record.outcomes["failed_no_replica"] == 0
    followers = [r for r in calls if r.after >= 0]
    assert all(fleet_run._parked == {} and sent[r.index] >= ended[r.after] for r in followers)  # after its base, always
    # each aLoRA call finds the whole chunks of its base call's prompt: 32 to 128 of its 72 to 136 tokens
    assert 0.3 < record.cached_tokens / record.prompt_tokens < 0.6


def test_validation_scales_the_profile_by_how_much_slower_passes_ran_under_load() -> None:
    from collections import Counter

    from bench.sim.served_costs import Measured, pass_ratio, under_load

    def passes(steps: int, prompt: int, generated: int, times: float) -> Counter:
        predicted = steps * PROFILE.step_overhead_s + prompt * PROFILE.prompt_token_s + generated * PROFILE.decode_seq_s
        return Counter({"loraplex_engine_steps_total": steps, "loraplex_engine_prompt_tokens_total": prompt,
                        "loraplex_engine_generated_tokens_total": generated, "loraplex_engine_step_seconds_sum": predicted * times})

    loaded = passes(300, 30_000, 5_000, 1.35)
    assert pass_ratio(PROFILE, loaded) == pytest.approx(1.35)
    scaled_profile, factor = under_load(PROFILE, Measured(loaded, Counter()))
    assert factor == pytest.approx(1.35)
    assert scaled_profile.step_s(100, 3) == pytest.approx(1.35 * PROFILE.step_s(100, 3))
    assert (scaled_profile.hop_s, scaled_profile.l2_fetch_token_s) == (0.0, None)  # not measured: not modelled
    assert under_load(PROFILE, Measured(Counter(), Counter()))[1] == 1.0  # nothing measured: unchanged
    # the workers' part of 40 first tokens took 12 s, the load tester saw 14 s: 50 ms each on the way there and back
    workers = Counter({"loraplex_gateway_worker_ttft_seconds_sum": 12.0, "loraplex_gateway_worker_ttft_seconds_count": 40,
                       "loraplex_cache_lookup_seconds_sum": 0.4 + 1_000 * 32 * 20e-6, "loraplex_cache_lookup_seconds_count": 40,
                       "loraplex_cache_hit_chunks_l2": 1_000})
    lone = Counter({"loraplex_cache_lookup_seconds_sum": 0.12, "loraplex_cache_lookup_seconds_count": 12})  # 10 ms a miss
    hopped, _ = under_load(PROFILE, Measured(loaded + workers, lone, ttft_s=14.0, num_ttfts=40, chunk_tokens=32))
    assert hopped.hop_s == pytest.approx(0.05)
    assert (hopped.l2_lookup_s, hopped.l2_fetch_token_s) == pytest.approx((0.01, 20e-6))  # a round trip, a token fetched
    fleet = scenario()
    plain = Fleet(fleet, fleet.scenario, PROFILE, fleet_module.place(fleet, 4), "ours").run()
    late = Fleet(fleet, fleet.scenario, replace(PROFILE, hop_s=0.02), fleet_module.place(fleet, 4), "ours").run()
    assert late.ttft_s == pytest.approx([t + 0.02 for t in plain.ttft_s])  # every TTFT, and nothing else


def test_validation_models_the_engine_loops_time_around_its_passes() -> None:
    from collections import Counter

    from bench.sim.served_costs import loop_terms

    def counted(steps: int, deltas: int, around_s: float) -> Counter:
        return Counter({"loraplex_engine_steps_total": steps, "loraplex_engine_loop_deltas_total": deltas,
                        "loraplex_engine_step_seconds_sum": 2.0, "loraplex_engine_loop_seconds_total": 2.0 + around_s})

    warm_up, lone = counted(300, 900, 300 * 0.002 + 900 * 0.004), counted(30, 30, 30 * 0.006)
    assert loop_terms(warm_up, lone) == pytest.approx((0.002, 0.004))  # a part per pass, a part per delta
    assert loop_terms(warm_up, counted(30, 30, 1.0)) == pytest.approx((0.0, 4.2 / 900))  # a part < 0: all per delta
    assert loop_terms(Counter(), Counter()) == (0.0, 0.0)

    # in the replica model each step takes its pass and the loop's time around it: a part, and a part per delta
    looped = replace(PROFILE, loop_step_s=0.003, loop_delta_s=0.002)
    replica = ReplicaModel(0, looped, PrefixCache(32, True, 0), frozenset())
    seqs = [Seq(SimRequest(i, 0.0, "t", "base", -1, 0, 20, 3), 0.0) for i in range(2)]
    assert all(replica.offer(seq) for seq in seqs)
    end_s = replica.start(0.0)  # both prompts in one pass: two first tokens, two deltas
    assert end_s == pytest.approx(PROFILE.step_s(40, 0) + 0.003 + 2 * 0.002)
    replica.finish_steps(end_s)
    after = replica.start(end_s)  # two decoding sequences, to their end
    assert after - end_s == pytest.approx(2 * (PROFILE.step_s(0, 2) + 0.003 + 2 * 0.002))
    replica.finish_steps(after)
    assert replica.stats.pass_s == pytest.approx(PROFILE.step_s(40, 0) + 2 * PROFILE.step_s(0, 2))
    assert replica.stats.busy_s == pytest.approx(after)


def test_replicas_on_shared_cores_slow_down_with_the_engines_and_the_serving_work_beside_them() -> None:
    from collections import Counter

    from bench.sim.contention import WINDOW_S, SharedCores
    from bench.sim.served_costs import Measured, beyond_passes, on_shared_cores

    class Replica:
        num_steps = 0

    one, other = Replica(), Replica()
    cores = SharedCores(2, 0.25, [one, other])
    assert cores.factor(0.0) == 1.0  # one engine on two cores: as calibrated
    other.num_steps = 3
    assert cores.factor(0.0) == 1.0  # both engines, as calibrated, and no serving work
    for at_s in (0.1, 0.2, 0.3, 0.4):
        cores.arrived(at_s)
    assert cores.factor(1.0) == pytest.approx((2 + 4 * 0.25 / WINDOW_S) / 2)  # 0.5 of a core serving four requests
    assert cores.factor(0.35 + WINDOW_S) == pytest.approx((2 + 0.25 / WINDOW_S) / 2)  # the first three are past the window
    # a replica's own process serving its requests holds the interpreter lock its engine needs: 0.5 of its time here
    gil = SharedCores(2, 0.25, [one, other], replica_cpu_request_s=0.25)
    for at_s in (0.1, 0.2, 0.3, 0.4):
        gil.arrived(at_s)
        gil.reached(at_s, 0)
    on_cores = (2 + 4 * 0.25 / WINDOW_S) / 2
    assert gil.factor(1.0, 0) == pytest.approx(on_cores / (1 - 4 * 0.25 / WINDOW_S))
    assert gil.factor(1.0, 1) == pytest.approx(on_cores)  # the other replica's process serves none of them
    # measured: 150 CPU s busy over the warm-up, 120 of them in passes, 60 requests: 0.5 s a request; the replicas'
    # processes 132 CPU s, 12 of them beside their passes: 0.2 s a request
    measured = Measured(Counter({"loraplex_engine_pass_cpu_seconds_total": 120.0}), Counter(), num_sent=60, busy_cpu_s=150.0,
                        replicas_cpu_s=132.0, cores=2)
    assert beyond_passes(measured.busy_cpu_s, measured) == pytest.approx(0.5)
    shared = on_shared_cores(PROFILE, measured)
    assert (shared.shared_cores, shared.serving_cpu_request_s, shared.step_s(10, 2)) == (2, pytest.approx(0.5), PROFILE.step_s(10, 2))
    assert shared.replica_cpu_request_s == pytest.approx(0.2)
    assert on_shared_cores(PROFILE, Measured(Counter(), Counter())) is None  # not measured
    # in the fleet, more serving work a request: slower passes, later first tokens
    fleet = scenario()
    plain = Fleet(fleet, fleet.scenario, replace(PROFILE, shared_cores=2), fleet_module.place(fleet, 2), "ours").run()
    busy = Fleet(fleet, fleet.scenario, replace(PROFILE, shared_cores=2, serving_cpu_request_s=0.2),
                 fleet_module.place(fleet, 2), "ours").run()
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    assert sum(busy.busy_s) > sum(plain.busy_s) and median(busy.ttft_s) > median(plain.ttft_s)
