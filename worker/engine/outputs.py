"""What a request has produced so far inside the engine, and what the engine has computed
(torch-free plain data). What each step adds to a request goes out as the contract's `Delta`
(worker/contract/calls.py), its last carrying this result's summary."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric

from cache.stats import Histogram
from worker.contract.calls import Delta, TokenLogprob, Usage


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: str | None = None
    error_status: int | None = None  # with an error: the HTTP status it deserves (400: the request's own fault)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first prompt token has none
    alora_activation: int | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    queue_time_s: float = 0.0  # arrival to its first step
    prompt_time_s: float = 0.0  # arrival to first token
    decode_time_s: float = 0.0  # first token to finish
    stop_word: str | None = None  # the stop string that ended it, if one did
    stop_logprob: float | None = None  # with logprobs: of the end-of-generation or stop token that ended it (not in token_ids)
    num_drafted: int = 0  # speculative drafts verified
    num_draft_accepted: int = 0  # ... of them accepted (each is one of token_ids)

    def last_delta(self, token_ids: tuple[int, ...], text: str, logprobs: tuple[TokenLogprob, ...] | None, *, index: int,
                   request_id: str, others_running: int) -> Delta:
        """The ended choice's last delta: its last new tokens, and this summary of it."""
        return Delta(
            token_ids, text, logprobs, self.finish_reason, self.error, self.error_status,
            usage=Usage(len(self.prompt_ids), len(self.token_ids), self.cached_tokens),
            queue_time_s=self.queue_time_s, prompt_time_s=self.prompt_time_s, decode_time_s=self.decode_time_s,
            prompt_logprobs=tuple(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            alora_activation=self.alora_activation, num_drafted=self.num_drafted, num_draft_accepted=self.num_draft_accepted,
            stop_word=self.stop_word, stop_logprob=self.stop_logprob, index=index, others_running=others_running,
            request_id=request_id,
        )


@dataclass
class StepTokens:
    """What one step added to a choice: its tokens, their text and log-probabilities, the drafts accepted."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_accepted: int = 0

    def delta_fields(self) -> tuple[tuple[int, ...], str, tuple[TokenLogprob, ...] | None]:
        """The contract's Delta's first fields: token ids, text, log-probabilities (None: none asked)."""
        return tuple(self.token_ids), self.text, tuple(self.logprobs) if self.logprobs else None


STEP_BUCKETS_S = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFTS_KEPT = 256  # recent times to first token kept (a replica reports their p90 to its shard's autoscaling)


@dataclass(eq=False)  # hashable by identity: a registry keys its collectors by hash
class EngineCounters:
    """What the engine has computed since it started (read from any thread: plain counts), and
    how long its forward passes took: all of them, and those that only decode (what a streamed
    token waits between two when no prompt shares the pass). Its own registry reads them at
    each scrape."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt positions run through the model (not those loaded from the prefix cache or forked)
    generated_tokens: int = 0
    forked_prompt_tokens: int = 0  # prompt positions copied to a request's other choices instead of computed
    drafted_tokens: int = 0  # speculative drafts verified (not generated tokens: those accepted are counted there too)
    accepted_draft_tokens: int = 0
    # the engine loop's iterations that ran a pass, whole: the pass, and around it the schedule, prefix loads and stores,
    # postprocessing and the deltas' delivery (what a stream waits for beyond the pass), and the deltas they delivered
    loop_s: float = 0.0
    loop_deltas: int = 0
    pass_cpu_s: float = 0.0  # the CPU time of the thread that ran the passes, during them (with 1 torch thread: theirs)
    step_s: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    decode_step_s: Histogram = field(default_factory=lambda: Histogram(STEP_BUCKETS_S))
    # (ended at, on the engine's clock; time to first token) of the latest choices that had a first token
    ttfts: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=TTFTS_KEPT), repr=False, compare=False)
    registry: CollectorRegistry = field(init=False, repr=False, compare=False)

    HELP = {"steps": "engine steps (forward passes) run",
            "prompt_tokens": "prompt tokens computed (not loaded from the prefix cache or forked)",
            "generated_tokens": "tokens generated",
            "forked_prompt_tokens": "prompt tokens a request's further choices copied instead of computing",
            "drafted_tokens": "speculative draft tokens verified",
            "accepted_draft_tokens": "speculative draft tokens accepted (the acceptance rate: over drafted_tokens)"}

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def step(self, prompt_tokens: int, seconds: float, cpu_s: float = 0.0) -> None:
        """One forward pass ran: its prompt tokens, how long it took, and the CPU time of the thread that ran it."""
        self.steps += 1
        self.pass_cpu_s += cpu_s
        self.prompt_tokens += prompt_tokens
        self.step_s.observe(seconds)
        if prompt_tokens == 0:
            self.decode_step_s.observe(seconds)

    def iteration(self, seconds: float, num_deltas: int) -> None:
        """One iteration of the engine loop that ran a pass took `seconds` and delivered `num_deltas`."""
        self.loop_s += seconds
        self.loop_deltas += num_deltas

    def collect(self) -> Iterator[Metric]:
        """The `loraplex_engine_*_total` counters and the step-time histograms, as they stand now."""
        for name, help_text in self.HELP.items():
            yield CounterMetricFamily(f"loraplex_engine_{name}_total", help_text, getattr(self, name))
        yield CounterMetricFamily("loraplex_engine_loop_seconds_total", "time of the engine loop's iterations that ran a "
                                  "pass: the pass, and the schedule, prefix loads and stores, postprocessing and delivery "
                                  "around it", self.loop_s)
        yield CounterMetricFamily("loraplex_engine_loop_deltas_total", "deltas those iterations delivered", self.loop_deltas)
        yield CounterMetricFamily("loraplex_engine_pass_cpu_seconds_total", "CPU time of the thread that ran the passes, "
                                  "during them (torch's other threads not counted)", self.pass_cpu_s)
        yield self.step_s.add_to(HistogramMetricFamily("loraplex_engine_step_seconds",
                                                       "time of a forward pass (prefill, decode or both)"))
        yield self.decode_step_s.add_to(HistogramMetricFamily("loraplex_engine_decode_step_seconds",
                                                              "time of a forward pass that only decodes"))

    def prometheus(self) -> str:
        """Its metrics in Prometheus' text format."""
        return generate_latest(self.registry).decode()
