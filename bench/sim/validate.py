"""The simulator against reality: one small scenario (bench/sim/scenarios/validate-2replicas.yaml:
2 CPU replicas of one shard, three adapters and the base, a few requests/s) served for real by
`loraplex serve` under the load tester, and simulated with a profile that `loraplex calibrate`
measures just before, on a replica's share of this machine's cores beside the other replica's
engine (`--concurrent 2`); then tables of TTFT, ITL and throughput, real against simulated, with the
relative error: with the bare profile, with the model (the profile on cores shared with the serving path,
and the serving path's own terms, all measured on the server before the measured run:
bench/sim/served_costs.py), and with one factor in place of the shared cores.

    python -m bench.sim.validate [--rate-rps R] [--duration-s T] [--profile FILE.yaml] [--out DIR]
    python -m bench.sim.validate --replay DIR  # the simulated side again, on what a run left in DIR

The simulation replays the load tester's own requests (its plan_workload: the same arrivals,
adapters, prompt and output lengths, shared prefixes), not a draw of its own from the seed. ITL
is per request, its mean gap between tokens (the simulator's definition; streamed chunks may
hold several tokens); "gap p99" is over every gap. Everything this starts (a redis-server of its
own, `loraplex serve`) it stops by pid.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.cluster import free_port
from bench.server import ROOT, Server, base_config, loadtest
from bench.sim.machine import OTHERS_SHARE, CPUShare, PrivateRedis, machine_busy_s, own_cpu_s
from bench.sim.profile import CostProfile, load_profile
from bench.sim.record import RunRecord
from bench.sim.served_costs import Measured, on_shared_cores, pass_ratio, under_load
from bench.sim.validate_figures import (
    NUM_REPLICAS,
    TOLERANCE,
    TracedFleet,
    lone_figures,
    real_figures,
    sim_figures,
    sim_requests,
    simulated,
    table,
    twins,
)
from bench.sim.workload import FleetScenario, SimRequest, load_fleet_scenario, scaled
from gateway.config import ServeConfig, parse_config
from gateway.loadtest.generators import plan_workload
from gateway.loadtest.scenario import Scenario, load_scenario

SCENARIO = Path(__file__).parent / "scenarios" / "validate-2replicas.yaml"
REAL_RUN = "real-run.json"  # in --out: what the real run measured, for --replay
ADAPTERS = ["caps", "json", "signature"]  # deploy/serve.yaml's, all on both replicas
OPERATOR_KEY = "sk-loraplex-operator"  # deploy/serve.yaml's
WARM_UP_S = 15.0  # load before the measured run (another seed: other prefixes), for the replicas' one-time costs
MEASURED_WARM_UP_S = 30.0  # then load of a third seed, over which the serving path's costs are measured (served_costs)
LONE_PROMPT_TOKENS, LONE_NEW_TOKENS = 64, 32
LONE = {"name": "one-at-a-time", "seed": 1, "warmup_s": 0, "duration_s": 300, "max_requests": 12,
        "load": {"mode": "closed", "users": 1}, "adapters": {"names": ["caps"], "weights": {"caps": 1.0}},
        "prompts": {"kind": "random", "length": {"min": LONE_PROMPT_TOKENS, "max": LONE_PROMPT_TOKENS}},
        "output_tokens": {"min": LONE_NEW_TOKENS, "max": LONE_NEW_TOKENS}}  # an idle server's TTFT and gaps


def served_config(redis_url: str | None, directory: Path) -> dict:
    """deploy/serve.yaml with one shard of the three adapters on NUM_REPLICAS replicas, a Redis (None: none) and cache
    namespace of its own."""
    config = base_config(f"loraplex-validate-{uuid.uuid4().hex[:8]}")
    config["adapters"] = [a for a in config["adapters"] if a["name"] in ADAPTERS]
    config["shards"] = [{"name": "all", "adapters": ADAPTERS, "replicas": NUM_REPLICAS, "num_cpus": 0}]
    config["tenants"] = [t for t in config["tenants"] if t["id"] == "demo"]
    config["cache"]["redis_url"] = redis_url
    config["registry"] = {"store_dir": str(directory / "store"), "allowed_paths": [str(ROOT / "deploy" / "adapters")]}
    return config


def calibrate(config_path: Path, adapter_paths: Sequence[str], threads: int, out: Path, rounds: int) -> Path:
    command = [sys.executable, "-m", "gateway.cli", "calibrate", "--out", str(out), "--config", str(config_path),
               "--threads", str(threads), "--rounds", str(rounds), "--concurrent", str(NUM_REPLICAS)]
    for path in adapter_paths:
        command += ["--lora", path]
    subprocess.run(command, check=True)
    return out


def engine_totals(url: str) -> Counter:
    """The replicas' engine counters and pass times, summed, from the gateway's /metrics."""
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    text = urllib.request.urlopen(request, timeout=30).read().decode()
    wanted = {"loraplex_engine_steps_total", "loraplex_engine_prompt_tokens_total", "loraplex_engine_generated_tokens_total",
              "loraplex_engine_step_seconds_sum", "loraplex_engine_step_seconds_count",
              "loraplex_engine_decode_step_seconds_sum", "loraplex_engine_decode_step_seconds_count",
              "loraplex_engine_loop_seconds_total", "loraplex_engine_loop_deltas_total",
              "loraplex_gateway_worker_ttft_seconds_sum", "loraplex_gateway_worker_ttft_seconds_count",
              "loraplex_cache_lookup_seconds_sum", "loraplex_cache_lookup_seconds_count",
              "loraplex_engine_pass_cpu_seconds_total"}
    totals: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] += sample.value
            elif sample.name == "loraplex_cache_hit_chunks_total" and sample.labels.get("tier") == "l2":
                totals["loraplex_cache_hit_chunks_l2"] += sample.value
    return totals


def client_figures(report_path: Path) -> tuple[float, int, int, float]:
    """What the load tester measured: its TTFTs' sum and count, how many requests it sent, and the answered ones' mean
    life (from sending to the last token)."""
    sent = json.loads(report_path.read_text())["requests"]
    ttfts = [r["ttft_s"] for r in sent if r["status"] == 200 and r["ttft_s"] is not None]
    lives = [r["e2e_s"] for r in sent if r["status"] == 200 and r["e2e_s"] is not None]
    return sum(ttfts), len(ttfts), len(sent), sum(lives) / len(lives) if lives else 0.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=str(SCENARIO), help="a fleet scenario (the load tester's format plus sim:)")
    parser.add_argument("--rate-rps", type=float, help="override the scenario's rate")
    parser.add_argument("--duration-s", type=float, help="override the scenario's duration_s")
    parser.add_argument("--profile", metavar="FILE.yaml", help="a calibrated profile (default: calibrate now)")
    parser.add_argument("--no-redis", action="store_true", help="no Redis tier: each replica's own prefix cache (simulated alike)")
    parser.add_argument("--calibrate-rounds", type=int, default=5)
    parser.add_argument("--out", metavar="DIR", help="where the config, profile and reports go (default: a new temporary directory)")
    parser.add_argument("--replay", metavar="DIR", help="nothing served: compare again what an earlier run left in DIR "
                        "(its --out: its scenario as served; give its --scenario again for the sim: section)")
    return parser.parse_args()


@dataclass
class Served:
    """The served config and its profile: given, or calibrated on this machine before serving."""

    config: ServeConfig
    threads: int  # per replica
    profile_path: Path
    cpu_calibrate: tuple[str, bool]  # CPUShare.done() while calibrating


@dataclass
class RealRun:
    """What serving the scenario for real measured."""

    report: Path  # the load tester's report of the measured run
    wall_s: float
    cpu: tuple[str, bool]  # CPUShare.done() during the measured run
    passes: Counter  # the replicas' engine counters over the measured run
    lone: tuple[float | None, float | None]  # one at a time: median TTFT and median mean gap
    measured: Measured  # over the (second) warm-up and the requests sent one at a time: the serving path's costs


def run_server(raw: dict, out: Path, threads: int, scenario: Scenario, scenario_path: Path, redis_pids: list[int]) -> RealRun:
    """`loraplex serve` of `raw`: the warm-up, requests one at a time, then the measured run; stopped by pid."""
    port = free_port()
    print(f"serving {NUM_REPLICAS} replicas ({threads} thread(s) each) on port {port}...", flush=True)
    server = Server(raw, out, port)
    try:
        loadtest(scenario_path, server.url, out / "warm-up", seed=scenario.seed + 1000, duration_s=WARM_UP_S)
        first, busy_s, (_, replicas_s) = engine_totals(server.url), machine_busy_s(), own_cpu_s([server.process.pid])
        warm_up_report = loadtest(scenario_path, server.url, out / "warm-up-measured", seed=scenario.seed + 2000,
                                  duration_s=MEASURED_WARM_UP_S)  # the serving path's costs: over this second warm-up
        warmed = engine_totals(server.url)
        ttft_s, num_ttfts, num_sent, life_s = client_figures(warm_up_report)
        warm_up = Measured(warmed - first, Counter(), ttft_s, num_ttfts, num_sent, busy_cpu_s=machine_busy_s() - busy_s,
                           replicas_cpu_s=own_cpu_s([server.process.pid])[1] - replicas_s, cores=os.cpu_count() or 1, life_s=life_s)
        lone_path = out / "one-at-a-time.yaml"
        lone_path.write_text(yaml.safe_dump({**LONE, "tenants": [t.model_dump() for t in scenario.tenants[:1]]}))
        lone = lone_figures(loadtest(lone_path, server.url, out / "one-at-a-time"))
        before = engine_totals(server.url)
        cpu, started = CPUShare([server.process.pid, *redis_pids]), time.perf_counter()
        report = loadtest(scenario_path, server.url, out / "real")
        wall_s, cpu_real = time.perf_counter() - started, cpu.done()
        passes = engine_totals(server.url) - before
    finally:
        stopped = server.stop()
    if not stopped:
        print("loraplex serve did not stop within its timeout: killed with everything it started", file=sys.stderr)
    return RealRun(report, wall_s, cpu_real, passes, lone, replace(warm_up, lone=before - warmed))


def save_run(served: Served, real_run: RealRun, out: Path) -> None:
    """What `replay` reads back: the served config's path and threads, the profile, and what the real run measured."""
    measured = asdict(real_run.measured)
    measured["warm_up"], measured["lone"] = dict(real_run.measured.warm_up), dict(real_run.measured.lone)
    (out / REAL_RUN).write_text(json.dumps({
        "threads": served.threads, "profile": str(served.profile_path), "cpu_calibrate": served.cpu_calibrate,
        "report": str(real_run.report), "wall_s": real_run.wall_s, "cpu": real_run.cpu, "passes": dict(real_run.passes),
        "lone": real_run.lone, "measured": measured}, indent=1))


def replay(out: Path) -> tuple[Served, RealRun]:
    """An earlier run's, from `save_run`'s file in its directory."""
    saved = json.loads((out / REAL_RUN).read_text())
    config = parse_config(yaml.safe_load((out / "serve.yaml").read_text()), out, str(out / "serve.yaml"))
    measured = saved["measured"]
    warm_up_report = out / "warm-up-measured" / "report.json"
    if "life_s" not in measured and warm_up_report.exists():  # a run from before it was kept: read off its warm-up's report
        measured["life_s"] = client_figures(warm_up_report)[3]
    measured = Measured(**{**measured, "warm_up": Counter(measured["warm_up"]), "lone": Counter(measured["lone"])})
    return (Served(config, saved["threads"], Path(saved["profile"]), tuple(saved["cpu_calibrate"])),
            RealRun(Path(saved["report"]), saved["wall_s"], tuple(saved["cpu"]), Counter(saved["passes"]), tuple(saved["lone"]),
                    measured))


def serve_for_real(args: argparse.Namespace, out: Path, scenario: Scenario, scenario_path: Path) -> tuple[Served, RealRun]:
    """The served config written to `out`, its profile calibrated (unless given), then served under the load tester."""
    redis_server = None if args.no_redis else PrivateRedis()
    try:
        raw = served_config(redis_server.url if redis_server else None, out)
        config_path = out / "serve.yaml"
        config_path.write_text(yaml.safe_dump(raw))
        config = parse_config(raw, out, str(config_path))
        threads = max(1, (os.cpu_count() or 1) // NUM_REPLICAS)  # what gateway/cluster/serve.py gives each CPU replica
        adapter_paths = [a["path"] for a in raw["adapters"]]
        cpu = CPUShare([])
        profile_path = Path(args.profile) if args.profile else calibrate(config_path, adapter_paths, threads, out / "profile.yaml",
                                                                         args.calibrate_rounds)
        cpu_calibrate = cpu.done() if not args.profile else ("not run (--profile)", False)
        real_run = run_server(raw, out, threads, scenario, scenario_path, [redis_server.process.pid] if redis_server else [])
    finally:
        if redis_server is not None:
            redis_server.stop()
    return Served(config, threads, profile_path, cpu_calibrate), real_run


@dataclass
class Comparison:
    """The simulation of the load tester's requests beside the real run: with the profile as
    calibrated, and with it scaled to the served replicas' load (`loaded_*`)."""

    profile: CostProfile
    loaded_profile: CostProfile
    factor: float  # the loaded profile's costs over the calibrated one's
    requests: list[SimRequest]
    record: RunRecord
    run: TracedFleet
    sim_wall_s: float
    real: dict[str, float | None]  # real_figures
    sim: dict[str, float | None]  # sim_figures with the calibrated profile
    text: str  # the table of those two
    off: list[str]  # its target figures outside TOLERANCE
    loaded_text: str  # the table with the loaded profile
    loaded_off: list[str]
    shared: tuple[CostProfile, str, list[str], float] | None = None  # on shared cores: its profile, table, misses, mean factor


def compare(fleet: FleetScenario, served: Served, real_run: RealRun) -> Comparison:
    scenario = fleet.scenario
    profile = replace(load_profile(str(served.profile_path)), engine=served.config.engine)  # the served engine, whatever the file says
    planned = plan_workload(scenario).requests  # the load tester's requests, as it planned them
    requests = sim_requests(planned, scenario)
    started = time.perf_counter()
    record, run = simulated(fleet, profile, served.config, requests)
    sim_wall_s = time.perf_counter() - started
    real, sim = real_figures(real_run.report, scenario), sim_figures(record, requests, scenario)
    text, off = table(real, sim)
    chunk_tokens = served.config.cache.chunk_tokens if served.config.cache.redis is not None else None
    measured = replace(real_run.measured, chunk_tokens=chunk_tokens)
    loaded_profile, factor = under_load(profile, measured)
    loaded_record, _ = simulated(fleet, loaded_profile, served.config, requests)
    loaded_text, loaded_off = table(real, sim_figures(loaded_record, requests, scenario))
    shared_profile, shared = on_shared_cores(profile, measured), None
    if shared_profile is not None:
        shared_record, shared_run = simulated(fleet, shared_profile, served.config, requests)
        mean_factor = (sum(r.stats.pass_s for r in shared_run.replicas)
                       / max(1e-9, sum(r.stats.profile_pass_s for r in shared_run.replicas)))
        shared = (shared_profile, *table(real, sim_figures(shared_record, requests, scenario)), mean_factor)
    return Comparison(profile, loaded_profile, factor, requests, record, run, sim_wall_s, real, sim, text, off, loaded_text,
                      loaded_off, shared)


def print_tables(scenario: Scenario, served: Served, real_run: RealRun, c: Comparison) -> None:
    """What was run, warnings about a busy machine, and the two tables (the calibrated profile, then under load)."""
    profile = c.profile
    print(f"\n{scenario.name}: {len(c.requests)} requests at {scenario.load.rate_rps:g} req/s over {scenario.duration_s:g} s "
          f"(the first {scenario.warmup_s:g} s not measured); {NUM_REPLICAS} replicas of one shard, {served.threads} thread(s) each; "
          f"profile {served.profile_path} (step_overhead_s {profile.step_overhead_s}, prompt_token_s {profile.prompt_token_s}, "
          f"decode_seq_s {profile.decode_seq_s}, decode_context_s {profile.decode_context_s}); "
          f"real {real_run.wall_s:.0f} s, simulated in {c.sim_wall_s:.2f} s; "
          f"CPU during calibration: {served.cpu_calibrate[0]}; during the real run: {real_run.cpu[0]}; measured requests that failed: "
          f"{c.real['failed']} real, {c.sim['failed']} simulated\n")
    for what, (_, is_shared) in (("calibration", served.cpu_calibrate), ("the real run", real_run.cpu)):
        if is_shared:
            print(f"WARNING: other processes took more than {OTHERS_SHARE:.0%} of the busy CPU during {what}: "
                  "these figures are not this code's alone; run it again on a quiet machine")
    print(c.text)
    loaded = c.loaded_profile
    lookup = (f"a prefix lookup {1e3 * loaded.l2_lookup_s:.2f} ms + {1e6 * loaded.l2_fetch_token_s:.1f} us a token fetched from "
              "Redis" if loaded.l2_fetch_token_s is not None else "no prefix lookups measured")
    print(f"\nunder load: the profile's costs x{c.factor:.2f}, the served passes' time under the warm-up's load over the "
          f"profile's prediction for them (one request at a time: x{pass_ratio(profile, real_run.measured.lone) or 0:.2f}); "
          f"{1e3 * loaded.hop_s:.1f} ms of hops added to each TTFT (the warm-up's TTFT less its workers' part); the engine "
          f"loop's time around a pass {1e3 * loaded.loop_step_s:.2f} ms + {1e3 * loaded.loop_delta_s:.2f} ms a delta; {lookup}; "
          "all measured before the measured run, not fitted to it\n")
    print(c.loaded_text)
    if c.shared is not None:
        shared_profile, shared_text, _, mean_factor = c.shared
        print(f"\non shared cores: the profile's passes slowed as the {shared_profile.shared_cores} cores are shared at each "
              f"moment by the engines and {1e3 * shared_profile.serving_cpu_request_s:.0f} ms of the serving path's CPU a "
              f"request (the machine's busy CPU over the warm-up less its passes' threads', over its requests; "
              f"{1e3 * shared_profile.replica_cpu_request_s:.0f} ms of it in the replica's process, beside its engine), spent "
              f"over a request's life ({shared_profile.serving_window_s:.2f} s: the warm-up's mean from sending to the "
              f"last token); the same terms beside them; its passes x{mean_factor:.2f} on average (the warm-up's measured "
              f"x{c.factor:.2f})\n")
        print(shared_text)


def print_passes(real_run: RealRun, c: Comparison) -> None:
    """The passes, real against simulated; request by request; one request at a time."""
    passes, lone, profile = real_run.passes, real_run.lone, c.profile
    real_busy_s = passes["loraplex_engine_step_seconds_sum"]
    sim_busy_s = sum(c.record.busy_s)
    sim_steps = sum(r.stats.num_steps for r in c.run.replicas)
    print(f"\nthe measured run's own passes over the profile's prediction for them: x{pass_ratio(profile, passes) or 0:.2f} "
          f"(the profile under load took x{c.factor:.2f} from the warm-up)")
    print(f"passes, both replicas, the whole run: real {passes['loraplex_engine_steps_total']:.0f} passes, "
          f"{real_busy_s:.1f} s in the model runner (from /metrics; the engine's schedule and postprocess not counted), "
          f"{passes['loraplex_engine_prompt_tokens_total']:.0f} prompt tokens computed; simulated {sim_steps} steps, "
          f"{sim_busy_s:.1f} s ({sim_busy_s / real_busy_s - 1:+.0%})" if real_busy_s else "no passes in /metrics")
    if passes["loraplex_engine_loop_seconds_total"]:
        steps, deltas = passes["loraplex_engine_steps_total"], passes["loraplex_engine_loop_deltas_total"]
        outside_s = passes["loraplex_engine_loop_seconds_total"] - real_busy_s
        modelled_s = c.loaded_profile.loop_step_s * steps + c.loaded_profile.loop_delta_s * deltas
        print(f"the engine loops' time around those passes: {outside_s:.1f} s, {1e3 * outside_s / steps:.2f} ms a pass, "
              f"for {deltas:.0f} deltas; the model under load: {modelled_s:.1f} s for the same passes and deltas")
    if passes["loraplex_engine_decode_step_seconds_count"]:
        decode_s = passes["loraplex_engine_decode_step_seconds_sum"] / passes["loraplex_engine_decode_step_seconds_count"]
        slots = profile.engine.num_seq_slots
        print(f"a real pass that only decodes: {1e3 * decode_s:.1f} ms on average; the profile's at 1 sequence "
              f"{1e3 * profile.step_s(0, 1):.1f} ms, at {slots} {1e3 * profile.step_s(0, slots):.1f} ms")
    print(twins(real_run.report, c.requests, c.run))
    if c.real["worker_itl_p50_s"] is not None:
        print(f"the real ITL at the workers (their answers' timings, without the way back to the load tester): p50 "
              f"{1e3 * c.real['worker_itl_p50_s']:.1f} ms, p99 {1e3 * c.real['worker_itl_p99_s']:.1f} ms; at the load tester "
              f"{1e3 * c.real['itl_p50_s']:.1f} and {1e3 * c.real['itl_p99_s']:.1f} ms")
    if lone[0] is not None and lone[1] is not None:
        print(f"one request at a time on the idle server ({LONE_PROMPT_TOKENS} prompt tokens, {LONE_NEW_TOKENS} new; median): "
              f"TTFT real {1e3 * lone[0]:.1f} ms, the profile's pass {1e3 * profile.step_s(LONE_PROMPT_TOKENS, 0):.1f} ms; "
              f"gap real {1e3 * lone[1]:.1f} ms, the profile's decode pass {1e3 * profile.step_s(0, 1):.1f} ms")


def print_verdict(c: Comparison, out: Path) -> None:
    """The verdict of the model (on shared cores, with the serving path's terms), then of the two it improves on."""
    if c.shared is not None:
        print(f"\nTHE MODEL (on shared cores), outside {TOLERANCE:.0%}: {', '.join(c.shared[2])}" if c.shared[2] else
              f"\nTHE MODEL (on shared cores): every target figure within {TOLERANCE:.0%}")
    else:
        print("\nno serving CPU measured (a server without loraplex_engine_pass_cpu_seconds_total): no model on shared cores")
    print(f"one factor from the warm-up instead, outside {TOLERANCE:.0%}: {', '.join(c.loaded_off) or 'none'}")
    print(f"the bare engine's profile, outside {TOLERANCE:.0%}: {', '.join(c.off) or 'none'} (what it leaves out: the "
          "serving path's hops, its CPU on the engines' cores, the engine loop around each pass, prefix lookups)")
    print(f"(config, profile and reports in {out})")


def main() -> int:
    args = parse_args()
    out = Path(args.replay or args.out or tempfile.mkdtemp(prefix="loraplex-validate-"))
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_fleet_scenario(args.scenario)
    scenario_path = out / "scenario.yaml"  # the load tester's part
    if args.replay:  # the scenario as that run served it
        fleet = FleetScenario(load_scenario(scenario_path), loaded.sim)
        served, real_run = replay(out)
    else:
        fleet = FleetScenario(scaled(loaded.scenario, args.rate_rps, args.duration_s), loaded.sim)
        scenario_path.write_text(yaml.safe_dump(fleet.scenario.model_dump(mode="json")))
        served, real_run = serve_for_real(args, out, fleet.scenario, scenario_path)
        save_run(served, real_run, out)
    comparison = compare(fleet, served, real_run)
    print_tables(fleet.scenario, served, real_run, comparison)
    print_passes(real_run, comparison)
    print_verdict(comparison, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
