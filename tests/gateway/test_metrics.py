"""gateway/metrics.py: an HTTP answer is counted once, by whichever of respond()'s Timing
(`finished`) and the HTTP edge (`answered`) comes first; a choice's inter-token latency from the
worker's timings; the workers' metrics merged with a replica label."""

from __future__ import annotations

import pytest

from gateway.metrics import GatewayMetrics, merge_worker_metrics
from worker.contract.calls import Delta, Usage


def requests(metrics: GatewayMetrics) -> dict[tuple[str, ...], float]:
    family = next(f for f in metrics.requests.collect())
    return {(s.labels["tenant"], s.labels["adapter"], s.labels["endpoint"], s.labels["status"]): s.value
            for s in family.samples if s.name.endswith("_total")}


def test_an_answer_respond_counted_is_not_counted_again_by_the_http_edge() -> None:
    metrics = GatewayMetrics()
    with metrics.answering():
        metrics.finished("t1", "a", "chat", 200, 0.5, 0.1, None)
        metrics.answered("chat", 200, lambda: pytest.fail("the tenant is looked up only for an answer counted here"))
    assert requests(metrics) == {("t1", "a", "chat", "200"): 1}


def test_an_answer_the_http_edge_counted_first_is_not_counted_again_by_respond() -> None:
    metrics = GatewayMetrics()
    with metrics.answering():
        metrics.answered("chat", 200, lambda: "t1")
        metrics.finished("t1", "a", "chat", 200, 0.5, 0.1, None)  # late (a stream its client left): timed, not counted
    assert requests(metrics) == {("t1", "", "chat", "200"): 1}
    assert metrics.latency.labels("t1", "a", "chat")._sum.get() == 0.5


def test_each_request_is_counted_on_its_own_and_outside_a_request_every_call_counts() -> None:
    metrics = GatewayMetrics()
    for status in (401, 429):
        with metrics.answering():
            metrics.answered("completions", status, lambda: "")
    metrics.finished("t1", "base", "completions", 200, 0.1, None, None)
    metrics.finished("t1", "base", "completions", 200, 0.1, None, None)
    assert requests(metrics) == {("", "", "completions", "401"): 1, ("", "", "completions", "429"): 1,
                                 ("t1", "base", "completions", "200"): 2}


def test_a_finished_choice_observes_its_mean_time_between_tokens() -> None:
    metrics = GatewayMetrics()
    metrics.choice_finished("t1", "a", Delta(finish_reason="length", usage=Usage(10, 5, 0), decode_time_s=0.2))
    metrics.choice_finished("t1", "a", Delta(finish_reason="stop", usage=Usage(10, 1, 0), decode_time_s=0.0))  # one token: no gap
    metrics.choice_finished("t1", "a", Delta(finish_reason="error", status=500))
    histogram = metrics.itl.labels("t1", "a")
    assert histogram._sum.get() == pytest.approx(0.05)
    assert sum(bucket.get() for bucket in histogram._buckets) == 1


def test_workers_metrics_are_merged_with_a_replica_label() -> None:
    text = ("# HELP loraplex_cache_lookups_total prefix lookups\n# TYPE loraplex_cache_lookups_total counter\n"
            "loraplex_cache_lookups_total 3\n")
    merged = merge_worker_metrics({"s1-0": text, "s1-1": text.replace(" 3", " 4")})
    assert merged.count("# TYPE loraplex_cache_lookups_total") == 1
    assert 'loraplex_cache_lookups_total{replica="s1-0"} 3' in merged and 'loraplex_cache_lookups_total{replica="s1-1"} 4' in merged
