"""An autoscaled shard through a burst, on the multi-node topology (issue 50's "Real" figure).

    python -m bench.autoscale_burst [--model tiny|default|BASE.gguf] [--burst-users 16 | --burst-rps R] ...

`loraplex serve` on bench/cluster/topology.py (a Ray head with the gateway, one worker node per
replica the shard may have, a Redis Cluster, moto's S3) with one shard of `autoscaling:
{min_replicas, max_replicas, ...}`, and in one run: a steady light load throughout (one client,
whole and streamed requests in turn, a pause between them); from the shard at min_replicas, a
burst from the project's load tester (gateway/loadtest, streamed): closed loop, more requests at
once than one replica's KV slots and fewer than its slots and queue (beyond, the gateway refuses
with 503), or open loop at `--burst-rps`; the light load on until the shard is back at
min_replicas, and a while after. Printed, from that run:

- each new replica: seconds from the burst's start to Serve starting it, to its phase up
  (/health), to the gateway's first route decision for it (/metrics
  loraplex_gateway_route_decisions_total{replica=...} rising) and to its first answer (the
  `x-loraplex-replica` of a request it served);
- seconds from the burst's end (its last request answered) to the shard back at min_replicas;
- requests that failed while the shard scaled down (must be 0), whole requests that failed
  throughout (must be 0), streams that failed throughout, and why they failed;
- the replicas' phases over time, one letter each (U up, S starting, D draining, A asleep);
- with `--simulate PROFILE`: the same scenario in the simulator (bench/sim/burst.py, the run's flags
  set in bench/sim/scenarios/autoscale-burst.yaml), its figures beside the real run's.

Every host is on this one machine: its cores are shared by every node, so the timings are
those of this machine and its load, not a cluster's. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import shutil
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.cluster import free_port
from bench.cluster.bench import percentile
from bench.cluster.topology import Topology
from bench.sim.burst import BurstFigures, BurstShape, beside
from bench.autoscale_readings import Request, Sample, at_min, failed_between, first_after, first_leaving, real_figures, scale_up, timeline
from bench.sim.machine import machine_busy_s
from gateway.loadtest.generators import plan_workload
from gateway.loadtest.runner import Result, run_workload
from gateway.loadtest.scenario import Scenario, parse_scenario
from gateway.policy.autoscale import AutoscalingSettings

INGRESS_LABEL = "loraplex.io/ingress"
KEY, OPERATOR_KEY = "sk-bench-autoscale", "sk-bench-autoscale-operator"
SHARD = "s"
POLL_S = 0.5
PROMPT_TOKENS, MAX_TOKENS = 12, 16  # the light client's requests
DEFAULT_VOCAB = 4096  # prompt ids are drawn below this (and the tiny model's vocabulary)


def from_result(result: Result, t0_s: float) -> Request:
    started = t0_s + result.start_s
    is_ok = result.status == 200 and not result.error
    return Request(started, started + (result.e2e_s or 0.0), is_ok, True, result.replica, result.ttft_s,
                   "" if is_ok else f"{result.status} {result.error[:120]}")


class Watch:
    """The gateway's /health phases and /metrics route decisions every POLL_S, in a thread, until stopped."""

    def __init__(self, url: str, replicas: Sequence[str]) -> None:
        self.url, self.replicas = url, list(replicas)
        self.samples: list[Sample] = []
        self.num_errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=10) as client:
            while not self._stop.is_set():
                try:
                    self.samples.append(self._read(client))
                except (httpx.HTTPError, ValueError, KeyError) as e:
                    self.num_errors += 1
                    print(f"watch: {type(e).__name__}: {e}", file=sys.stderr)
                self._stop.wait(POLL_S)

    def _read(self, client: httpx.Client) -> Sample:
        health = client.get("/health").json()
        phases = {r["id"]: r.get("phase", "up") for r in health["shards"][SHARD]["replicas"]}
        routed: dict[str, float] = {}
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("loraplex_gateway_route_decisions_total{") and 'replica="' in line:
                replica = line.split('replica="', 1)[1].split('"', 1)[0]
                routed[replica] = routed.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
        return Sample(time.monotonic(), tuple(phases.get(r, "?") for r in self.replicas),
                      tuple(routed.get(r, 0.0) for r in self.replicas))

    def wait(self, holds, timeout_s: float) -> float | None:
        """When the first sample from now on for which `holds(phases)` was taken; None past `timeout_s`."""
        since, deadline = time.monotonic(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = first_after(self.samples, since, lambda s: holds(s.phases))
            if found is not None:
                return found
            time.sleep(POLL_S / 2)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class LightLoad:
    """One client: whole and streamed requests in turn, `gap_s` apart, until stopped."""

    def __init__(self, url: str, model: str, vocab: int, gap_s: float) -> None:
        self.url, self.model, self.vocab, self.gap_s = url, model, vocab, gap_s
        self.requests: list[Request] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = random.Random(0)
        with httpx.Client(timeout=90, headers={"Authorization": f"Bearer {KEY}"}) as client:
            n = 0
            while not self._stop.is_set():
                prompt = [rng.randrange(100, self.vocab) for _ in range(PROMPT_TOKENS)]
                self.requests.append(self._ask(client, prompt, is_streamed=n % 2 == 1))
                n += 1
                self._stop.wait(self.gap_s)

    def _ask(self, client: httpx.Client, prompt: list[int], is_streamed: bool) -> Request:
        body = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": is_streamed}
        started, ttft_s, why, replica = time.monotonic(), None, "", ""
        try:
            with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                replica = r.headers.get("x-loraplex-replica", "")
                if r.status_code != 200:
                    why = f"{r.status_code} {r.read().decode(errors='replace')[:120]}"
                elif not is_streamed:
                    r.read()
                else:
                    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                    ttft_s = time.monotonic() - started
                    errors = [e for e in events if '"error"' in e]
                    why = errors[0][:120] if errors else ("" if events and events[-1] == "[DONE]" else "cut: no [DONE]")
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"[:120]
        return Request(started, time.monotonic(), not why, is_streamed, replica, ttft_s, why)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def burst_scenario(args: argparse.Namespace, vocab: int) -> Scenario:
    return parse_scenario({
        "name": "autoscale-burst", "seed": args.seed, "duration_s": args.burst_s, "max_requests": 20_000,
        "load": ({"mode": "open", "arrivals": "poisson", "rate_rps": args.burst_rps, "max_in_flight": 64} if args.burst_rps
                 else {"mode": "closed", "users": args.burst_users}),
        "tenants": [{"name": "bench", "key": KEY}], "adapters": {"names": ["base"], "weights": {"base": 1}},
        "prompts": {"kind": "random", "length": {"min": 8, "max": 16}},
        "output_tokens": {"min": args.burst_tokens, "max": args.burst_tokens}, "vocab_size": vocab,
    }, "the burst")


def autoscaling(args: argparse.Namespace) -> dict:
    return {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas, "target_utilization": args.target,
            "upscale_delay_s": args.upscale_delay, "downscale_delay_s": args.downscale_delay, "lead_s": args.lead}


def model_for(choice: str, topology: Topology) -> tuple[str | None, str, int]:
    """(the config's model, its name, the vocabulary prompts are drawn from)."""
    if choice == "default":
        return None, "smollm2-135m-instruct", DEFAULT_VOCAB
    if choice == "tiny":
        from tests.tinymodels import TinySpec, make_tiny_model  # the tests' tiny random llama (writes a GGUF; imports torch)

        tiny = make_tiny_model(topology.root, TinySpec())
        return str(tiny.path), "tiny", tiny.spec.vocab_size
    return choice, "base", DEFAULT_VOCAB


def run(args: argparse.Namespace) -> tuple[int, BurstFigures | None]:
    """The exit status, and the run's figures (None if the shard never settled)."""
    replicas = [f"{SHARD}-{i}" for i in range(args.max_replicas)]
    print(f"autoscale-burst: one shard, {autoscaling(args)}, {args.slots} KV slots a replica; starting the topology...", flush=True)
    topology = Topology(head_cpus=1, head_labels=f"{INGRESS_LABEL}=yes", subnet=args.subnet)
    try:
        for i in range(args.max_replicas):  # one worker node a replica
            topology.add_worker(f"n{i + 1}", num_cpus=1)
        model, name, vocab = model_for(args.model, topology)
        config = topology.config(
            model, name,
            shards=[{"name": SHARD, "adapters": [], "num_cpus": 1, "autoscaling": autoscaling(args)}],
            tenants=[{"id": "bench", "key_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]}],
            operator_key_sha256=[hashlib.sha256(OPERATOR_KEY.encode()).hexdigest()],
            engine={"num_seq_slots": args.slots},
            http={"host": "0.0.0.0", "port": free_port(), "request_timeout_s": 120, "node_labels": {INGRESS_LABEL: "yes"}},
        )
        started = time.monotonic()
        with topology.serving(config) as serving:
            print(f"serving {name} at {serving.url} ({time.monotonic() - started:.0f} s to ready)", flush=True)
            return measure(serving.url, name, vocab, replicas, args)
    finally:
        if args.keep_logs is not None:
            keep_logs(topology, args.keep_logs)
        topology.close()


def keep_logs(topology: Topology, to: Path) -> None:
    """The head's Ray logs (Serve's controller and the gateway among them), before `close` removes them."""
    logs = topology.ray.head_dir / "ray"
    for path in logs.rglob("*"):
        if path.suffix in (".log", ".err", ".out") and path.is_file():
            target = to / path.relative_to(logs)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
    print(f"the head's Ray logs are in {to}")


def measure(url: str, model: str, vocab: int, replicas: list[str], args: argparse.Namespace) -> tuple[int, BurstFigures | None]:
    low = args.min_replicas
    watch = Watch(url, replicas)
    light: LightLoad | None = None
    try:
        if watch.wait(lambda p: at_min(p, low), args.settle_timeout) is None:
            print(f"the shard was not at min_replicas within {args.settle_timeout:g} s: {timeline(watch.samples, time.monotonic())}")
            return 1, None
        light = LightLoad(url, model, vocab, args.light_gap)
        time.sleep(args.light_before)
        busy_s = machine_busy_s()
        scenario = burst_scenario(args, vocab)
        planned = plan_workload(scenario, []).requests
        how = f"{args.burst_rps:g} requests/s (open loop)" if args.burst_rps else f"{args.burst_users} users back to back"
        print(f"burst: {how} for {args.burst_s:g} s (streamed, {args.burst_tokens} tokens each)...", flush=True)
        t0 = time.monotonic()
        results = asyncio.run(run_workload(scenario, url, planned, model, {"bench": KEY}, progress=False))
        burst_end = time.monotonic()
        busy_s = machine_busy_s() - busy_s
        back = watch.wait(lambda p: at_min(p, low), args.down_timeout)
        time.sleep(args.light_after)
    finally:
        if light is not None:
            light.stop()
        watch.stop()
    return report(watch, light.requests if light else [], results, (t0, burst_end, back), busy_s, replicas, args)


def report(watch: Watch, light: list[Request], results: list[Result], times: tuple[float, float, float | None],
           busy_s: float, replicas: list[str], args: argparse.Namespace) -> tuple[int, BurstFigures]:
    """Prints the run's figures; the exit status (0: scaled up and back, nothing failed) and the figures."""
    (t0, burst_end, back), samples, low = times, watch.samples, args.min_replicas
    burst = [from_result(r, t0) for r in results]
    everything = light + burst
    most = max((sum(p == "up" for p in s.phases) for s in samples if s.at_s >= t0), default=0)
    drained = first_leaving(samples, t0)
    cut = failed_between(everything, drained, back if back is not None else samples[-1].at_s) if drained is not None else []
    whole = [r for r in light if not r.is_streamed]
    streams = [r for r in everything if r.is_streamed]
    ttfts = [r.ttft_s for r in burst if r.is_ok and r.ttft_s is not None]
    print()
    print(f"burst: {len(burst)} requests in {burst_end - t0:.1f} s, {sum(not r.is_ok for r in burst)} failed; "
          f"TTFT p50 {1e3 * percentile(ttfts, 0.5):.0f} ms p99 {1e3 * percentile(ttfts, 0.99):.0f} ms; "
          f"replicas up at most: {most} of {args.max_replicas}")
    idle = [r.ended_s - r.started_s for r in whole if r.is_ok and r.ended_s < t0]
    print(f"the light client's whole requests before the burst: p50 {1e3 * percentile(idle, 0.5):.0f} ms ({len(idle)}); "
          f"the machine's busy CPU in the burst {busy_s:.0f} s, {1e3 * busy_s / max(1, len(burst)):.0f} ms a burst request")
    ups = [scale_up(samples, everything, replica, index, t0) for index, replica in enumerate(replicas[low:], start=low)]
    for replica, up in zip(replicas[low:], ups):
        print(f"{replica}: from the burst's start, starting {fmt(up['starting'])}, up {fmt(up['up'])}, "
              f"first routed to {fmt(up['routed'])}, first answer {fmt(up['answered'])}")
    print(f"back at min_replicas ({low}) {fmt(None if back is None else back - burst_end)} after the burst's end "
          f"(the first replica left {fmt(None if drained is None else drained - burst_end)} after it)")
    print(f"requests failed while scaling down: {len(cut)}; whole requests failed throughout: {sum(not r.is_ok for r in whole)} "
          f"of {len(whole)}; streams failed throughout: {sum(not r.is_ok for r in streams)} of {len(streams)} "
          f"({len(light)} light requests, {len(burst)} in the burst); /health or /metrics unread {watch.num_errors} times")
    for why, n in Counter(r.why for r in everything if not r.is_ok).most_common(5):
        print(f"  {n} failed: {why}")
    print(f"timeline (s from the burst's start; {', '.join(replicas)}: U up, S starting, D draining, A asleep; "
          f"burst end {burst_end - t0:+.1f} s):")
    print(f"  {timeline(samples, t0)}")
    is_ok = most > low and back is not None and not cut and all(r.is_ok for r in everything)
    return (0 if is_ok else 1), real_figures(samples, everything, ups, times, most, percentile(ttfts, 0.5))


def fmt(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds:.1f} s"


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.autoscale_burst", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny (the tests' random llama: default), default (SmolLM2-135M) or a GGUF")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=3, help="also the worker nodes started (one a replica)")
    p.add_argument("--target", type=float, default=0.5, help="autoscaling.target_utilization (default: 0.5)")
    p.add_argument("--upscale-delay", type=float, default=1.0, help="autoscaling.upscale_delay_s (default: 1)")
    p.add_argument("--downscale-delay", type=float, default=10.0, help="autoscaling.downscale_delay_s (default: 10)")
    p.add_argument("--lead", type=float, default=0.0, help="autoscaling.lead_s (default: 0)")
    p.add_argument("--slots", type=int, default=4, help="engine.num_seq_slots: a replica's KV slots (default: 4)")
    p.add_argument("--burst-users", type=int, default=16,
                   help="the burst's clients, each one request at a time (default: 16: a replica's slots and queue hold them)")
    p.add_argument("--burst-rps", type=float, help="instead: this many requests/s, open loop (past the replicas' slots and "
                   "queues, the gateway refuses with 503)")
    p.add_argument("--burst-s", type=float, default=40.0, help="the burst lasts this long (default: 40)")
    p.add_argument("--burst-tokens", type=int, default=32, help="tokens a burst request generates (default: 32)")
    p.add_argument("--light-gap", type=float, default=1.0, help="the light client's pause between requests (default: 1 s)")
    p.add_argument("--light-before", type=float, default=15.0, help="light load alone before the burst (default: 15 s)")
    p.add_argument("--light-after", type=float, default=10.0, help="light load once back at min_replicas (default: 10 s)")
    p.add_argument("--settle-timeout", type=float, default=180.0)
    p.add_argument("--down-timeout", type=float, default=240.0, help="the most waited for min_replicas after the burst")
    p.add_argument("--subnet", default="10.78.0", help="the hosts' /24 (another than a multi-node test's beside it)")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy the head's Ray logs (Serve's controller, the gateway) here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", metavar="PROFILE", help="also run the same scenario in the simulator on this profile "
                   "(bench/sim/profiles: tiny-2core for --model tiny) and print the two side by side")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.simulate and args.burst_rps:
        print("--simulate mirrors a closed-loop burst (--burst-users), not --burst-rps", file=sys.stderr)
        return 2
    code, real = run(args)
    if args.simulate and real is not None:
        os.nice(19)  # the real run is over: the simulation at the lowest priority
        shape = BurstShape(args.burst_users, args.burst_s, args.burst_tokens, args.light_gap, args.light_before, args.light_after)
        print(beside(real, args.simulate, AutoscalingSettings(**autoscaling(args)), args.slots, shape, SHARD))
    return code


if __name__ == "__main__":
    sys.exit(main())
