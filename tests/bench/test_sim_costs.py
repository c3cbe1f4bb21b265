"""The simulator's costs: a decoding sequence's context (calibrate measures it with decoders of short and long
contexts, fitted as a fourth coefficient, and a simulated replica's decode passes grow with it), and a validation
run's measurements kept for comparing again without serving."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest
import yaml

from bench.sim.calibrate import Fit, Sample, fit, medians
from bench.sim.replica import PrefixCache, ReplicaModel, Seq
from bench.sim.served_costs import Measured
from bench.sim.validate import RealRun, Served, replay, save_run, served_config
from bench.sim.workload import SimRequest
from gateway.config import parse_config
from tests.bench.test_sim import PROFILE

TRUE = Fit(step_overhead_s=0.015, prompt_token_s=0.0012, decode_seq_s=0.0015, decode_context_s=5e-6)


def test_the_fit_recovers_what_a_decoding_sequences_context_costs() -> None:
    shapes = [(0, 1, 10), (0, 4, 10), (0, 8, 10), (0, 1, 258), (0, 4, 258), (0, 8, 258), (64, 0, 0), (256, 0, 0), (128, 8, 10)]
    result = fit({shape: TRUE.step_s(*shape) for shape in shapes})
    assert (result.step_overhead_s, result.prompt_token_s, result.decode_seq_s, result.decode_context_s) == pytest.approx(
        (TRUE.step_overhead_s, TRUE.prompt_token_s, TRUE.decode_seq_s, TRUE.decode_context_s), rel=1e-6)
    # without long contexts the same passes read as dearer sequences and no context (the profiles before this term)
    short = fit({shape: TRUE.step_s(*shape) for shape in shapes if shape[2] < 100})
    assert short.decode_context_s == 0.0 or short.decode_context_s == pytest.approx(TRUE.decode_context_s, rel=1e-6)


def test_medians_keep_short_and_long_contexts_apart() -> None:
    samples = [Sample(0, 4, 0.022, context) for context in (9, 10, 11, 12)]
    samples += [Sample(0, 4, 0.028, context) for context in (257, 258, 259, 260)]
    samples.append(Sample(64, 0, 0.09))
    assert medians(samples) == {(0, 4, 10): (pytest.approx(0.022), 4), (0, 4, 258): (pytest.approx(0.028), 4),
                                (64, 0, 0): (pytest.approx(0.09), 1)}


def test_a_simulated_replicas_decode_passes_grow_with_their_context() -> None:
    costly = replace(PROFILE, decode_context_s=1e-4)
    replica = ReplicaModel(0, costly, PrefixCache(32, True, 0), frozenset())
    seqs = [Seq(SimRequest(i, 0.0, "t", "base", -1, 0, 100, 5), 0.0) for i in range(2)]
    assert all(replica.offer(seq) for seq in seqs)
    end_s = replica.start(0.0)  # both prompts in one pass (no sequence decodes: no context's cost)
    assert end_s == pytest.approx(PROFILE.step_s(200, 0))
    replica.finish_steps(end_s)
    after = replica.start(end_s)  # two sequences decode 4 tokens as one run, attending 101, 102, 103 and 104 positions
    assert replica.num_steps == 4
    assert after - end_s == pytest.approx(sum(PROFILE.step_s(0, 2) + 1e-4 * 2 * context for context in (101, 102, 103, 104)))
    assert after - end_s > 4 * PROFILE.step_s(0, 2)


def test_a_validation_run_is_kept_and_compared_again_as_it_was(tmp_path) -> None:
    raw = served_config(None, tmp_path)
    (tmp_path / "serve.yaml").write_text(yaml.safe_dump(raw))
    served = Served(parse_config(raw, tmp_path, str(tmp_path / "serve.yaml")), 1, tmp_path / "profile.yaml", ("quiet", False))
    measured = Measured(Counter({"loraplex_engine_steps_total": 900.0}), Counter({"loraplex_engine_steps_total": 12.0}), ttft_s=3.5,
                        num_ttfts=40, num_sent=41, busy_cpu_s=80.5, replicas_cpu_s=60.25, cores=2, chunk_tokens=None)
    real_run = RealRun(tmp_path / "real" / "report.json", 72.5, ("busy", True), Counter({"loraplex_engine_step_seconds_sum": 77.0}),
                       (0.1, None), measured)
    save_run(served, real_run, tmp_path)
    again_served, again_run = replay(tmp_path)
    assert again_run == real_run
    assert (again_served.threads, again_served.profile_path, again_served.cpu_calibrate) == (1, served.profile_path, ("quiet", False))
    assert again_served.config.shards == served.config.shards


def test_the_real_itl_at_the_workers_reads_their_answers_timings(tmp_path) -> None:
    from bench.sim.validate import SCENARIO
    from bench.sim.validate_figures import real_figures
    from bench.sim.workload import load_fleet_scenario

    def worker_itl(path, scenario):  # noqa: ANN001, ANN202 - the real figures' workers' ITL p50 and p99
        figures = real_figures(path, scenario)
        return figures["worker_itl_p50_s"], figures["worker_itl_p99_s"]

    row = {"start_s": 20.0, "status": 200, "completion_tokens": 5, "itl_s": [0.03] * 4, "ttft_s": 0.1, "prompt_tokens": 8,
           "cached_tokens": 0}
    rows = [{**row, "worker_decode_s": 0.1}, {**row, "worker_decode_s": 0.1}, {**row, "worker_decode_s": 0.2},
            {**row, "start_s": 1.0, "worker_decode_s": 9.0},  # in the warm-up: not measured
            {**row, "completion_tokens": 1, "worker_decode_s": 0.0}, {**row, "worker_decode_s": None}]
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"requests": rows}))
    scenario = load_fleet_scenario(str(SCENARIO)).scenario  # its first 10 s not measured
    assert worker_itl(path, scenario) == (pytest.approx(0.025), pytest.approx(0.05, abs=0.0011))
    path.write_text(json.dumps({"requests": [{**row, "worker_decode_s": None}]}))
    assert worker_itl(path, scenario) == (None, None)


def test_the_serving_work_is_spread_over_a_requests_measured_life() -> None:
    from bench.sim.contention import SharedCores
    from bench.sim.served_costs import on_shared_cores

    class Replica:
        num_steps = 0

    short = SharedCores(2, 0.25, [Replica(), Replica()], window_s=0.5)
    for at_s in (0.1, 0.2, 0.3, 0.4):
        short.arrived(at_s)
    assert short.factor(0.45) == pytest.approx((1 + 4 * 0.25 / 0.5) / 2)  # two cores' worth of serving work, as it arrives
    assert short.factor(0.95) == pytest.approx(1.0)  # half a second on, their lives are over and their work done
    measured = Measured(Counter({"loraplex_engine_pass_cpu_seconds_total": 120.0}), Counter(), num_sent=60, busy_cpu_s=150.0,
                        replicas_cpu_s=132.0, cores=2, life_s=0.8)
    assert on_shared_cores(PROFILE, measured).serving_window_s == 0.8
