"""The gateway's Prometheus metrics (`loraplex_gateway_*`), per tenant and adapter set.

Each gateway keeps its own registry, so several in one process (tests) do not
collide; `/metrics` renders it with the workers' cache metrics appended.

`loraplex_gateway_requests_total` counts every HTTP answer once: respond()'s Timing counts the
requests it answers (`finished`), the HTTP edge (gateway/http/observed.py) the rest (`answered`:
refused before they reached a worker, and every other route), each within its request's
`answering()`, whichever comes first (a llama-server batch of prompts is one answer).

A worker knows adapters by fingerprint only (names never cross the wire), so what is counted per
adapter set is counted here, from each choice's last delta: its speculative drafts too
(`loraplex_gateway_drafted_tokens_total`), beside each replica's totals (`loraplex_engine_*`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from cache.stats import exposition
from worker.contract.calls import Delta

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass
class _Answer:
    is_counted: bool = False


_ANSWER: ContextVar[_Answer | None] = ContextVar("loraplex_answer", default=None)  # the HTTP request being answered


RESIDENCY_TIERS = ("device", "host", "lower")  # gateway/policy/routing/view.py: ReplicaView.tier


def adapter_label(names: Iterable[str]) -> str:
    """A request's adapters, as its tenant named them, in one metric label."""
    return "+".join(sorted(set(names))) or "base"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        labels = ("tenant", "adapter", "endpoint")
        self.requests = Counter("loraplex_gateway_requests", "requests answered, by status", (*labels, "status"), registry=r)
        self.latency = Histogram("loraplex_gateway_request_seconds", "arrival to last byte", labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.ttft = Histogram("loraplex_gateway_ttft_seconds", "arrival to first token", labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.worker_ttft = Histogram("loraplex_gateway_worker_ttft_seconds", "arrival at its worker to first token, on the "
                                     "worker's clock (prefix lookup, queue, prefill): the TTFT less this is the way there and back",
                                     labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("loraplex_gateway_itl_seconds", "a choice's mean time between tokens: its decode time / (tokens - 1)",
                             ("tenant", "adapter"), buckets=ITL_BUCKETS_S, registry=r)
        self.drafted = Counter("loraplex_gateway_drafted_tokens", "speculative draft tokens verified for the choices that "
                               "finished (their timings' draft_n)", ("tenant", "adapter"), registry=r)
        self.accepted_drafts = Counter("loraplex_gateway_accepted_draft_tokens", "of those, the drafts accepted "
                                       "(draft_n_accepted; the acceptance rate: over drafted_tokens)", ("tenant", "adapter"), registry=r)
        self.queued = Histogram("loraplex_gateway_queue_seconds", "time a request waited in its worker's queue before its first step",
                                labels, buckets=LATENCY_BUCKETS_S, registry=r)
        self.tokens_in = Counter("loraplex_gateway_prompt_tokens", "prompt tokens", labels, registry=r)
        self.tokens_out = Counter("loraplex_gateway_completion_tokens", "generated tokens", labels, registry=r)
        self.cached = Counter("loraplex_gateway_cached_tokens", "prompt tokens served from the prefix cache", labels, registry=r)
        self.in_flight = Gauge("loraplex_gateway_in_flight", "requests in progress (queue depth)", ("tenant",), registry=r)
        self.routes = Counter("loraplex_gateway_route_decisions", "requests sent to a replica", ("shard", "replica", "policy"), registry=r)
        self.residency = Counter("loraplex_gateway_routed_residency", "requests sent to a replica, by where it had their "
                                 "adapters (device, host, lower: disk or the store)", ("tier",), registry=r)
        self.failures = Counter("loraplex_gateway_replica_failures", "replicas that failed a request", ("replica",), registry=r)

    def route(self, shard: str, replica: str, policy: str, tier: int = 0) -> None:
        self.routes.labels(shard, replica, policy).inc()
        self.residency.labels(RESIDENCY_TIERS[tier]).inc()

    def replica_failure(self, replica: str) -> None:
        self.failures.labels(replica).inc()

    @contextmanager
    def answering(self) -> Iterator[None]:
        """One HTTP request's answer, counted once within it (by `finished` or `answered`)."""
        token = _ANSWER.set(_Answer())
        try:
            yield
        finally:
            _ANSWER.reset(token)

    def answered(self, endpoint: str, status: int, tenant: Callable[[], str]) -> None:
        """An answer the HTTP edge saw, unless `finished` counted it: its tenant looked up only then,
        its adapters not known there."""
        if self._take():
            self.requests.labels(tenant(), "", endpoint, str(status)).inc()

    def _take(self) -> bool:
        """Whether the request being answered is still to be counted; from now on it is not."""
        answer = _ANSWER.get()  # None outside an HTTP request (a test's direct call): counted
        if answer is None:
            return True
        is_new, answer.is_counted = not answer.is_counted, True
        return is_new

    def choice_finished(self, tenant: str, adapter: str, final: Delta) -> None:
        """A choice's last delta (its own timings: the worker's clock), and the speculative drafts
        its worker verified for it (a choice that drafted nothing adds no series)."""
        usage = final.usage
        if usage is not None and usage.completion_tokens > 1 and final.finish_reason in ("stop", "length"):
            self.itl.labels(tenant, adapter).observe(final.decode_time_s / (usage.completion_tokens - 1))
        if final.num_drafted:
            self.drafted.labels(tenant, adapter).inc(final.num_drafted)
            self.accepted_drafts.labels(tenant, adapter).inc(final.num_draft_accepted)

    def finished(self, tenant: str, adapter: str, endpoint: str, status: int, latency_s: float, ttft_s: float | None,
                 final: Delta | None) -> None:
        if self._take():
            self.requests.labels(tenant, adapter, endpoint, str(status)).inc()
        self.latency.labels(tenant, adapter, endpoint).observe(latency_s)
        if ttft_s is not None:
            self.ttft.labels(tenant, adapter, endpoint).observe(ttft_s)
        usage = final.usage if final is not None else None
        if usage:
            self.queued.labels(tenant, adapter, endpoint).observe(final.queue_time_s)
            if ttft_s is not None:
                self.worker_ttft.labels(tenant, adapter, endpoint).observe(final.prompt_time_s)
            self.tokens_in.labels(tenant, adapter, endpoint).inc(usage.prompt_tokens)
            self.tokens_out.labels(tenant, adapter, endpoint).inc(usage.completion_tokens)
            self.cached.labels(tenant, adapter, endpoint).inc(usage.cached_tokens)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def merge_worker_metrics(texts: dict[str, str]) -> str:
    """Workers' Prometheus text as one exposition: each family once, with every replica's samples
    of it, each with a `replica` label. A replica whose text does not parse is left out (logged)."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:
            log.warning("metrics: replica %s sent text that does not parse (%s)", replica, e)
            continue
        for family in parsed:
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type, family.unit))
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)
    return exposition(families.values())
