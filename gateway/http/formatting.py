"""What every API's answer is built from (torch-free): a request's usage over its choices, its
summary for metrics, llama-server's timings (which the OpenAI answers carry too, and on every
streamed token when asked), its prompt progress events, and server-sent event framing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from worker.contract.calls import Delta, Usage
from worker.formats.tokenizer import GGUFTokenizer

NO_USAGE = Usage(0, 0, 0)


def token_str(tokenizer: GGUFTokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id, skip_special=False).decode("utf-8", errors="replace")


def by_choice(deltas: Sequence[Delta]) -> dict[int, list[Delta]]:
    """A request's deltas per choice index, in index order."""
    groups: dict[int, list[Delta]] = {}
    for d in deltas:
        groups.setdefault(d.index, []).append(d)
    return dict(sorted(groups.items()))


def total_usage(finals: Sequence[Delta]) -> Usage:
    """The request's usage over its choices' last deltas: the prompt once, every choice's tokens."""
    us = [d.usage for d in finals if d.usage is not None]
    if not us:
        return NO_USAGE
    return Usage(us[0].prompt_tokens, sum(u.completion_tokens for u in us), us[0].cached_tokens)


def summary(finals: Sequence[Delta]) -> Delta:
    """One last delta for the request as a whole (metrics): choice 0's with the total usage."""
    return replace(finals[0], usage=total_usage(finals))


def usage(finals: Sequence[Delta]) -> dict[str, Any]:
    u = total_usage(finals)
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def llama_timings(final: Delta) -> dict[str, Any]:
    """llama-server's `timings` of a request, which the OpenAI answers carry too."""
    u = final.usage or NO_USAGE
    prompt_n, prompt_ms = u.prompt_tokens - u.cached_tokens, final.prompt_time_s * 1e3
    predicted_ms = final.decode_time_s * 1e3
    timings = {
        "cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else None,
        "prompt_per_second": prompt_n / final.prompt_time_s if final.prompt_time_s > 0 else None,
        "predicted_n": u.completion_tokens, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / u.completion_tokens if u.completion_tokens else None,
        "predicted_per_second": u.completion_tokens / final.decode_time_s if final.decode_time_s > 0 else None,
    }
    if final.num_drafted:  # as llama-server, only where speculative decoding drafted
        timings |= {"draft_n": final.num_drafted, "draft_n_accepted": final.num_draft_accepted}
    return timings


# Characters a JSON string may hold raw that Python's str.splitlines (httpx's `aiter_lines`, many SSE
# clients) takes for line breaks: escaped, so an event is one line for them too (SSE breaks only at CR, LF).
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)
    return f"data: {text}\n\n".encode()


def named_sse(data: dict[str, Any] | str) -> bytes:
    """An event named by its data's "type" (the Anthropic and Responses APIs' framing)."""
    name = data.get("type") if isinstance(data, dict) else None
    return (f"event: {name}\n" if name else "").encode() + sse(data)


class PromptProgress:
    """llama-server's `prompt_progress` events (`return_progress`) as the gateway can tell them. A
    worker reports nothing while it processes a prompt, and its cached tokens only with a choice's
    last delta, so a stream gets two events with its first delta: the start (what was cached counted
    as processed, as llama-server does) and the end (every prompt token processed, timed from the
    request's admission). When that first delta is also the last, its usage gives the cached tokens
    and the worker's own prompt time; otherwise no cached token is claimed (the last event's
    `timings.cache_n` says how many there were)."""

    def __init__(self, num_prompt_tokens: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total, self.clock = num_prompt_tokens, clock
        self.started_s = clock()

    def events(self, first: Delta) -> list[dict[str, Any]]:
        if first.usage is not None:
            cache, time_ms = first.usage.cached_tokens, first.prompt_time_s * 1e3
        else:
            cache, time_ms = 0, (self.clock() - self.started_s) * 1e3
        return [{"total": self.total, "cache": cache, "processed": cache, "time_ms": 0.0},
                {"total": self.total, "cache": cache, "processed": self.total, "time_ms": time_ms}]


class TokenTimings:
    """llama-server's `timings` on every streamed token (`timings_per_token`) as the gateway can
    tell them. A worker times a choice only on its last delta, so before it the figures are the
    gateway's own clock: the prompt from the request's admission to the choice's first delta
    (nothing claimed cached: the last delta's `cache_n` says), decoding from then to this delta,
    over the tokens so far. The last delta's are the worker's (`llama_timings`)."""

    def __init__(self, num_prompt_tokens: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.num_prompt_tokens, self.clock = num_prompt_tokens, clock
        self.started_s = clock()
        self._first_s: dict[int, float] = {}  # per choice: when its first delta came
        self._tokens: dict[int, int] = {}  # per choice: its tokens so far

    def of(self, delta: Delta) -> dict[str, Any]:
        """The timings to send with `delta`'s text (call once per delta of each choice)."""
        now = self.clock()
        first_s = self._first_s.setdefault(delta.index, now)
        tokens = self._tokens[delta.index] = self._tokens.get(delta.index, 0) + len(delta.token_ids)
        if delta.usage is not None:
            return llama_timings(delta)
        prompt_s, decode_s = first_s - self.started_s, now - first_s
        prompt_n = self.num_prompt_tokens
        return {
            "cache_n": 0, "prompt_n": prompt_n, "prompt_ms": prompt_s * 1e3,
            "prompt_per_token_ms": prompt_s * 1e3 / prompt_n if prompt_n else None,
            "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else None,
            "predicted_n": tokens, "predicted_ms": decode_s * 1e3,
            "predicted_per_token_ms": decode_s * 1e3 / tokens if tokens else None,
            "predicted_per_second": tokens / decode_s if decode_s > 0 else None,
        }
