"""gateway/metrics.py: a finished choice's speculative drafts counted under its tenant and adapter
set; a choice that drafted nothing adds no series (end to end: tests/gateway/api/llama/test_speculative_metrics.py)."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from worker.contract.calls import Delta, Usage


def counts(counter) -> dict[tuple[str, str], float]:
    return {(s.labels["tenant"], s.labels["adapter"]): s.value for f in counter.collect() for s in f.samples
            if s.name.endswith("_total")}


def test_drafts_are_counted_per_tenant_and_adapter_set_and_only_where_some_were_verified() -> None:
    metrics = GatewayMetrics()
    metrics.choice_finished("t1", "a+b", Delta(finish_reason="length", usage=Usage(4, 8, 0), num_drafted=6, num_draft_accepted=4))
    metrics.choice_finished("t1", "a+b", Delta(finish_reason="stop", usage=Usage(4, 3, 0), num_drafted=2))
    metrics.choice_finished("t2", "base", Delta(finish_reason="length", usage=Usage(4, 8, 0)))  # drafted nothing
    assert counts(metrics.drafted) == {("t1", "a+b"): 8}
    assert counts(metrics.accepted_drafts) == {("t1", "a+b"): 4}
