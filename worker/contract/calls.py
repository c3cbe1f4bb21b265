"""The call between gateway and worker: `WorkerCall` in, a stream of `Delta` out.

Plain frozen data (it crosses Ray Serve handles as pickles). A worker streams
one `Delta` per engine step that produced something for the request; the last
has `finish_reason` set and carries the summary (usage, timings, prompt
log-probabilities, the aLoRA's activation index). A request with n > 1 choices
streams every choice's deltas interleaved, each with its `index`; each choice's
last carries its own summary, and the request is over once no other is running.
A request that fails carries
the HTTP status its failure deserves in `status`: a request the worker refuses
before any work gets a single such `Delta` (400 for the request's own fault, 503
when the worker is too busy to take it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from worker.contract.identity import ScalesByFingerprint
from worker.contract.params import SamplingParams

# A replica's channel to a caller (worker/shard/channel.py) with nothing to deliver sends an empty
# batch this often, so the caller knows the replica is there (gateway/cluster/channel.py gives up on one
# silent for the routing's `unresponsive_after_s`) without waiting for Ray to find its node gone.
CHANNEL_HEARTBEAT_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkerCall:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    scales_by_fingerprint: ScalesByFingerprint = field(default_factory=dict)  # the adapters it enables, non-zero scales
    cache_salt: str = ""  # the tenant's prefix-cache namespace (docs/architecture.md#cache-keys)
    cache_prompt: bool = True  # False: neither reuse nor store this request's KV
    tenant: str = ""  # the worker shares prompt tokens and free KV slots fairly between tenants
    timeout_s: float | None = None  # from when the worker gets it: past this, the request ends with status 503 or 504
    traceparent: str | None = None  # W3C trace context of the gateway's span for it (worker/contract/tracing.py); None: untraced


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the K most likely tokens at this position, (id, logprob)


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


@dataclass(frozen=True, slots=True)
class Delta:
    """What one engine step added to one choice of a request: the engine's output, the
    channel's item and what the HTTP edge formats (one record all the way)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when the request asked for them
    finish_reason: str | None = None  # stop | length | cancelled | error, on the last delta
    error: str | None = None
    status: int | None = None  # with an error: the HTTP status it deserves (400: the request's fault; 503: busy, try elsewhere)
    # on the last delta only
    usage: Usage | None = None
    queue_time_s: float = 0.0  # arrival to its first engine step
    prompt_time_s: float = 0.0  # arrival to first token
    decode_time_s: float = 0.0  # first token to finish
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # echo with logprobs; the first prompt token has none
    alora_activation: int | None = None
    num_drafted: int = 0  # on the last delta: speculative drafts verified for this choice (llama-server's timings.draft_n)
    num_draft_accepted: int = 0  # ... and of them, those accepted (draft_n_accepted)
    stop_word: str | None = None  # on the last delta: the stop string that ended the request, if one did
    stop_logprob: float | None = None  # on the last delta, with logprobs: of the stop token that ended it (not returned)
    index: int = 0  # which of the request's n choices
    others_running: int = 0  # with finish_reason: choices of the request still running (0: the request is over)
    request_id: str = ""  # whose: a channel carries every request's deltas of a step together

    @property
    def is_finished(self) -> bool:
        """The request is over: this choice has finished and no other is running."""
        return self.finish_reason is not None and self.others_running == 0

    @classmethod
    def refused(cls, message: str, status: int = 400, request_id: str = "") -> Delta:
        """The request was not run: 400 for its own fault, 503 when the worker is too busy."""
        return cls(finish_reason="error", error=message, status=status, request_id=request_id)

    @classmethod
    def failed(cls, message: str, status: int | None = None, request_id: str = "") -> Delta:
        return cls(finish_reason="error", error=message, status=status, request_id=request_id)

    def merged(self, then: Delta) -> Delta:
        """This delta and the next of the same choice as one (`then`'s end, if it ends it)."""
        logprobs = (self.logprobs or ()) + (then.logprobs or ()) if self.logprobs or then.logprobs else None
        return replace(then, token_ids=self.token_ids + then.token_ids, text=self.text + then.text, logprobs=logprobs)
