"""The load tester: scenarios, deterministic workloads, the Zipf sampler's fit, the ideal
cache share, and a short run against a real server (HTTP, in-process workers on a tiny model)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
import redis
import uvicorn
import yaml
from scipy.stats import chisquare

from gateway.config import ConfigError
from gateway.loadtest.generators import PlannedRequest, WeightedSampler, arrival_times, mark_ideal_cache, plan_workload
from gateway.loadtest.scenario import load_scenario, parse_scenario
from tests.gateway.gateway_setup import KEYS, local_app, tiny_config

SCENARIOS = Path(__file__).resolve().parents[2] / "deploy" / "scenarios"
BASE = {"name": "t", "tenants": [{"name": "a"}], "adapters": {"names": ["x", "y"], "zipf_s": 1.0}, "prompts": {"kind": "random"}}


def test_the_shipped_scenarios_load() -> None:
    names = sorted(p.stem for p in SCENARIOS.glob("*.yaml"))
    assert names == ["alora-pipeline", "hot-shift", "noisy-tenant", "shared-prefix", "uniform", "zipf"]
    for path in SCENARIOS.glob("*.yaml"):
        assert plan_workload(load_scenario(path), [7, 8]).requests


@pytest.mark.parametrize(("change", "message"), [
    ({"adapters": {"names": ["x"], "zipf_s": 1.0, "weights": {"x": 1}}}, "exactly one of zipf_s and weights"),
    ({"adapters": {"names": ["x", "y"], "weights": {"x": 1}}}, "weights must name every adapter"),
    ({"prompts": {"kind": "alora_pipeline"}}, "alora_adapter is needed"),
    ({"phases": [{"at_s": 10, "shift": 1}, {"at_s": 5, "shift": 1}]}, "phases must be in order"),
    ({"load": {"mode": "sideways"}}, "load.mode"),
    ({"tenants": []}, "tenants"),
    ({"colour": 1}, "colour: Extra inputs are not permitted"),
    ({"phases": [{"at_s": 1, "burst": 5, "tenant": "a"}]}, "'a' is not a tenant with its own rate_rps"),
    ({"tenants": [{"name": "a", "rate_rps": 1.0}], "phases": [{"at_s": 1, "shift": 1, "tenant": "a"}]}, "takes no tenant"),
])
def test_a_bad_scenario_names_the_problem(change, message) -> None:
    with pytest.raises(ConfigError) as e:
        parse_scenario({**BASE, **change}, "s.yaml")
    assert message in str(e.value)


def test_workloads_are_deterministic_per_seed() -> None:
    scenario = load_scenario(SCENARIOS / "zipf.yaml")
    first, again = plan_workload(scenario), plan_workload(scenario)
    other = plan_workload(scenario.model_copy(update={"seed": 99}))
    key = lambda w: [(r.at_s, r.tenant, r.adapter, r.prompt_ids, r.max_tokens) for r in w.requests]  # noqa: E731
    assert key(first) == key(again) != key(other)


def test_the_zipf_sampler_fits_zipf_and_rotates() -> None:
    names = [f"a{i}" for i in range(10)]
    sampler, rng = WeightedSampler.zipf(names, 1.1), random.Random(0)
    counts = Counter(sampler.sample(rng) for _ in range(20000))
    expected = [20000 * sampler.probability(n) for n in names]
    assert chisquare([counts[n] for n in names], expected).pvalue > 0.001
    assert counts["a0"] > counts["a1"] > counts["a5"]
    sampler.rotate(1)  # the ranking moves: a9 is now the hottest
    assert sampler.probability("a1") == pytest.approx(1 / sum(1 / (k + 1) ** 1.1 for k in range(10)))
    counts = Counter(sampler.sample(rng) for _ in range(5000))
    assert counts.most_common(1)[0][0] == "a1"


def test_poisson_arrivals_follow_the_phase_rates() -> None:
    phases = [{"at_s": 100, "rate_rps": 8.0}, {"at_s": 150, "burst": 30}]
    scenario = parse_scenario({**BASE, "duration_s": 200, "load": {"rate_rps": 2.0}, "phases": phases})
    times = arrival_times(scenario, random.Random(1))
    before, after = sum(t < 100 for t in times), sum(t >= 100 for t in times) - 30
    assert abs(before - 200) < 4 * 200**0.5 and abs(after - 800) < 4 * 800**0.5
    assert Counter(times)[150] == 30


def test_a_tenant_phase_changes_that_tenants_arrivals_alone() -> None:
    """`tenant` on a phase: the burst and the new rate are that tenant's; the others arrive as before."""
    tenants = [{"name": "a", "weight": 3}, {"name": "b", "weight": 1}, {"name": "loud", "rate_rps": 1.0}]
    phases = [{"at_s": 50, "rate_rps": 10.0, "tenant": "loud"}, {"at_s": 60, "burst": 40, "tenant": "loud"},
              {"at_s": 100, "rate_rps": 1.0, "tenant": "loud"}]
    calm = parse_scenario({**BASE, "duration_s": 200, "max_requests": 10_000, "load": {"rate_rps": 4.0}, "tenants": tenants})
    loud = calm.model_copy(update={"phases": parse_scenario({**BASE, "tenants": tenants, "phases": phases}).phases})
    per_tenant = lambda scenario, name, start, end: sum(  # noqa: E731
        1 for r in plan_workload(scenario).requests if r.tenant == name and start <= r.at_s < end)
    assert per_tenant(loud, "loud", 50, 100) >= 40 + 500 - 4 * 500**0.5 > 3 * per_tenant(calm, "loud", 50, 100)
    assert per_tenant(loud, "loud", 100, 200) < 100 + 4 * 100**0.5
    shared = lambda scenario: [r.at_s for r in plan_workload(scenario).requests if r.tenant != "loud"]  # noqa: E731
    assert shared(loud) == shared(calm)  # (which of a and b each is, one random stream draws after the loud one's)


def test_the_ideal_cache_share_counts_whole_chunks_seen_before() -> None:
    prefix = list(range(100, 164))  # 64 tokens: 2 chunks of 32
    reqs = [
        PlannedRequest(0, "t1", "x", prefix + [1, 2, 3], 4),
        PlannedRequest(1, "t1", "x", prefix + [4, 5], 4),  # both chunks seen
        PlannedRequest(2, "t2", "x", prefix + [4, 5], 4),  # another tenant: nothing
        PlannedRequest(3, "t1", "y", prefix + [4, 5], 4),  # another adapter: nothing
        PlannedRequest(4, "t1", "base", prefix + [9], 4),
        PlannedRequest(5, "t1", "verify", prefix + [9, 7, 7], 4, "alora", alora_activation=40),  # the base's, before 40
    ]
    mark_ideal_cache(reqs, 32)
    assert [r.ideal_cached for r in reqs] == [0, 64, 0, 0, 0, 32]


@pytest.fixture
def live_server(tiny_llama, tmp_path):
    prefix = f"loraplex-test-{uuid.uuid4().hex}"
    app, pool = local_app(tiny_config(tiny_llama, tmp_path, prefix))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(10)
    pool.close()
    client = redis.Redis()
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)


def test_a_short_run_writes_the_json_the_markdown_and_the_plots(live_server, tmp_path, capsys) -> None:
    from gateway.cli import main as cli_main

    scenario = {
        "name": "tiny", "seed": 3, "duration_s": 6, "max_requests": 30, "chunk_tokens": 8, "vocab_size": 250,
        "load": {"mode": "open", "rate_rps": 4.0},
        "tenants": [{"name": "t1", "key": KEYS["t1"], "weight": 2}, {"name": "t2", "key": KEYS["t2"]}],
        "adapters": {"names": ["b", "base"], "zipf_s": 1.0},
        "prompts": {"kind": "shared_prefix", "num_prefixes": 2, "prefix_tokens": 32, "sharing": 1.0, "length": {"min": 4, "max": 12}},
        "output_tokens": {"min": 2, "max": 6},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(scenario))
    out = tmp_path / "report"
    assert cli_main(["loadtest", "--scenario", str(path), "--url", live_server, "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    summary = report["summary"]
    assert summary["latency"]["ok"] == len(report["requests"]) > 10 and not summary["errors_by_status"]
    assert summary["latency"]["ttft_s"]["p50"] > 0 and summary["throughput"]["requests_per_s"] > 0
    assert summary["cache"]["ideal_share"] > 0.3 and summary["cache"]["cached_share"] > 0.1
    assert set(summary["replicas"]["requests"]) <= {"s1-0", "s1-1", "s2-0"} and summary["replicas"]["max_over_mean"] >= 1
    assert set(summary["per_tenant"]) == {"t1", "t2"}
    answered = [r for r in report["requests"] if r["status"] == 200]  # the worker's time from first token to last, read
    assert all(0 <= r["worker_decode_s"] < r["e2e_s"] for r in answered)  # off the answer's timings
    assert any(r["worker_decode_s"] > 0 for r in answered if r["completion_tokens"] > 1)
    assert "# Load test: tiny" in (out / "report.md").read_text()
    for name in ("latency_cdf.png", "throughput.png", "ttft_per_adapter.png", "replica_load.png", "cache_hit.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Load test: tiny" in capsys.readouterr().out


def test_a_bad_url_or_scenario_exits_2(tmp_path, capsys) -> None:
    from gateway.cli import main as cli_main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert cli_main(["loadtest", "--scenario", str(path), "--url", "ftp://x"]) == 2
    assert "--url must be an http(s) URL" in capsys.readouterr().err
    assert cli_main(["loadtest", "--scenario", str(tmp_path / "missing.yaml"), "--url", "http://127.0.0.1:9"]) == 2
    assert "cannot read scenario" in capsys.readouterr().err


def test_warm_up_requests_are_left_out_of_the_figures() -> None:
    from gateway.loadtest.report import summarize
    from gateway.loadtest.runner import Result

    scenario = parse_scenario({**BASE, "warmup_s": 10})
    slow = Result("a", "x", "request", 1.0, 200, ttft_s=9.0, e2e_s=9.5, prompt_tokens=10, replica="r0")
    fast = [Result("a", "x", "request", 11.0 + i, 200, ttft_s=0.1, e2e_s=0.2, prompt_tokens=10, replica="r1") for i in range(5)]
    summary = summarize(scenario, [slow, *fast], 20.0)
    assert summary["latency"]["ttft_s"]["p99"] == 0.1 and summary["warmup"]["requests_left_out"] == 1
    assert summary["replicas"]["requests"] == {"r1": 5} and summary["throughput"]["requests_per_s"] == 0.5


def test_cache_share_over_time_covers_the_requests_that_ended_in_the_window() -> None:
    from gateway.loadtest.report import cache_share_over_time
    from gateway.loadtest.runner import Result

    def done(end_s: float, prompt: int, cached: int, ideal: int, status: int = 200) -> Result:
        return Result("t", "a", "random", end_s - 1.0, status, e2e_s=1.0, prompt_tokens=prompt, cached_tokens=cached, ideal_cached=ideal)

    results = [done(12.0, 100, 0, 50), done(1.0, 100, 0, 0), done(3.0, 100, 80, 80), done(4.0, 500, 0, 0, status=429)]
    times, achieved, ideal = cache_share_over_time(results, window_s=5.0)
    assert times == [1.0, 3.0, 12.0]  # in end order, answered requests only
    assert achieved == [0.0, 0.4, 0.0]  # at 12 s the first two are out of the window
    assert ideal == [0.0, 0.4, 0.5]


def test_a_stream_event_holding_a_unicode_line_separator_stays_one_event() -> None:
    """A token may decode to U+2028, U+2029 or U+0085: the gateway's events escape them (httpx's
    `aiter_lines` breaks lines there), and the load tester breaks lines only where SSE does."""
    import asyncio
    import json

    import httpx

    from gateway.http.formatting import sse
    from gateway.loadtest.runner import sse_lines

    text = "a\u2028b\u2029c\x85d é"
    ours = sse({"choices": [{"text": text}]})
    raw = f'data: {json.dumps({"choices": [{"text": text}]}, ensure_ascii=False)}\r\n\r\n'.encode()  # another server's
    body = ours + raw + b"data: [DONE]\n\n"

    async def chunks():  # cut anywhere, a CR LF across two chunks too
        for i in range(0, len(body), 7):
            yield body[i:i + 7]

    async def read(lines_of, keep_empty: bool = False) -> list[str]:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))
        async with httpx.AsyncClient(transport=transport) as client:
            async with client.stream("GET", "http://test/") as response:
                return [line async for line in lines_of(response) if line or keep_empty]

    lines = asyncio.run(read(sse_lines, keep_empty=True))
    assert lines == [ours.decode().split("\n")[0], "", raw.decode().split("\r\n")[0], "", "data: [DONE]", ""]
    assert [json.loads(line[6:])["choices"][0]["text"] for line in lines[:3:2]] == [text, text]
    plain = asyncio.run(read(lambda response: response.aiter_lines()))
    assert json.loads(plain[0][6:])["choices"][0]["text"] == text  # ours is one line even for aiter_lines
