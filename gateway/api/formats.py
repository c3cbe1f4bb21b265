"""Response bodies: OpenAI completions and chat (whole and streamed chunks, n choices each) and
llama-server's /completion, built from the worker's `Delta`s (torch-free)."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gateway.api.tools import ToolCall, ToolPlan, ToolReader
from worker.contract.calls import Delta, TokenLogprob, Usage
from worker.formats.tokenizer import GGUFTokenizer

_NO_USAGE = Usage(0, 0, 0)
SYSTEM_FINGERPRINT = "fp_loraplex"


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
        return _NO_USAGE
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


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", None if reason is None else "stop")


def _mean_logprob(deltas: Sequence[Delta]) -> float:
    """A choice's mean token log-probability, the token that ended it included (best_of's rank)."""
    entries = [e.logprob for d in deltas for e in d.logprobs or ()]
    if deltas[-1].stop_logprob is not None:
        entries.append(deltas[-1].stop_logprob)
    return sum(entries) / len(entries) if entries else float("-inf")


class CompletionFormatter:
    """`text_completion` objects; with `echo`, the prompt's text (and log-probabilities) lead.
    With `keep` (best_of), only the `keep` choices of highest mean token log-probability are
    returned, renumbered."""

    def __init__(self, tokenizer: GGUFTokenizer, model: str, prompt_ids: list[int], echo: bool, logprobs: int | None,
                 keep: int | None = None) -> None:
        self.tokenizer, self.model, self.prompt_ids, self.echo, self.k, self.keep = tokenizer, model, prompt_ids, echo, logprobs, keep
        self.id, self.created = f"cmpl-{time.time_ns():x}", int(time.time())
        self._offsets: dict[int, int] = {}  # per choice, streamed text so far

    def _logprobs(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None], offset: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, token_id in enumerate(ids):
            entry = entries[i] if i < len(entries) else None
            text = token_str(self.tokenizer, token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(None if entry is None else {token_str(self.tokenizer, t): lp for t, lp in entry.top})
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def prompt_text(self) -> str:
        return self.tokenizer.decode(self.prompt_ids) if self.echo else ""

    def _choice(self, index: int, deltas: list[Delta], prompt_logprobs: Sequence[TokenLogprob | None] | None) -> dict[str, Any]:
        final = deltas[-1]
        logprobs = None
        if self.k is not None:
            ids: list[int] = list(self.prompt_ids) if self.echo else []
            entries: list[TokenLogprob | None] = list(prompt_logprobs or [None]) if self.echo else []
            entries += [None] * (len(ids) - len(entries))
            for d in deltas:
                ids += [e.token_id for e in d.logprobs or ()]
                entries += list(d.logprobs or ())
            logprobs = self._logprobs(ids, entries, 0)[0]
        text = self.prompt_text() + "".join(d.text for d in deltas)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(final.finish_reason)}

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        groups = list(by_choice(deltas).values())
        finals = [group[-1] for group in groups]
        prompt_logprobs = next((d.prompt_logprobs for d in finals if d.prompt_logprobs), None)  # computed once, by choice 0
        if self.keep is not None:
            groups = sorted(groups, key=_mean_logprob, reverse=True)[: self.keep]
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [self._choice(i, group, prompt_logprobs) for i, group in enumerate(groups)],
            "usage": usage(finals), "timings": _llama_timings(summary(finals)),
        }

    def chunk(self, delta: Delta, first: bool) -> dict[str, Any]:
        text = (self.prompt_text() if first else "") + delta.text
        logprobs = None
        if self.k is not None and delta.logprobs:
            logprobs, self._offsets[delta.index] = self._logprobs([e.token_id for e in delta.logprobs], delta.logprobs,
                                                                  self._offsets.get(delta.index, 0))
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": delta.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(delta.finish_reason)}],
        }

    def usage_chunk(self, finals: Sequence[Delta]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [], "usage": usage(finals), "timings": _llama_timings(summary(finals))}


class ChatFormatter:
    """`chat.completion` objects; with `tools`, each choice's text is read for tool calls
    (gateway/api/tools.py): whole, or streamed as calls complete."""

    def __init__(self, tokenizer: GGUFTokenizer, model: str, logprobs: int | None, tools: ToolPlan | None = None) -> None:
        self.tokenizer, self.model, self.k, self.tools = tokenizer, model, logprobs, tools
        self.id, self.created = f"chatcmpl-{time.time_ns():x}", int(time.time())
        self._readers: dict[int, ToolReader] = {}  # per choice, when streaming with tools

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        data = self.tokenizer.token_bytes(token_id, skip_special=False)
        return {"id": token_id, "token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}  # id: llama-server's

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        if self.k is None:
            return None
        content = []
        for d in deltas:
            for e in d.logprobs or ():
                content.append({**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]})
        return {"content": content}

    def _finish_reason(self, delta: Delta, called: bool) -> str | None:
        reason = finish_reason(delta.finish_reason)
        return "tool_calls" if called and reason == "stop" else reason

    def _choice(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls: list[ToolCall] = []
        if self.tools is not None:
            message["content"], calls = self.tools.parse(text)
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(deltas), "finish_reason": self._finish_reason(deltas[-1], bool(calls))}

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        groups = by_choice(deltas)
        finals = [group[-1] for group in groups.values()]
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [self._choice(i, group) for i, group in groups.items()],
            "usage": usage(finals), "timings": _llama_timings(summary(finals)),
        }

    def _chunk(self, index: int, body: dict[str, Any], logprobs: dict[str, Any] | None = None, reason: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": index, "delta": body, "logprobs": logprobs, "finish_reason": reason}],
        }

    def chunk(self, delta: Delta, first: bool) -> list[dict[str, Any]]:
        role = {"role": "assistant"} if first else {}
        if self.tools is None:
            return [self._chunk(delta.index, {**role, "content": delta.text}, self._logprobs([delta]), finish_reason(delta.finish_reason))]
        reader = self._readers.setdefault(delta.index, self.tools.reader())
        bodies = [{"content": e} if isinstance(e, str) else {"tool_calls": [e]} for e in reader.feed(delta.text)]
        if delta.finish_reason is not None:
            bodies += [{"content": e} if isinstance(e, str) else {"tool_calls": [e]} for e in reader.finish()]
        if not bodies and (first or self.k is not None):
            bodies = [{"content": ""}]
        chunks = [self._chunk(delta.index, {**(role if i == 0 else {}), **body}) for i, body in enumerate(bodies)]
        if chunks:
            chunks[0]["choices"][0]["logprobs"] = self._logprobs([delta])
        if delta.finish_reason is not None:
            chunks.append(self._chunk(delta.index, {}, None, self._finish_reason(delta, reader.num_calls > 0)))
        return chunks

    def usage_chunk(self, finals: Sequence[Delta]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": [], "usage": usage(finals), "timings": _llama_timings(summary(finals))}


def tokenize_piece(tokenizer: GGUFTokenizer, token_id: int) -> dict[str, Any]:
    """llama-server's /tokenize piece: text when it is valid UTF-8, else its bytes."""
    piece = tokenizer.token_bytes(token_id, skip_special=False)
    try:
        return {"id": token_id, "piece": piece.decode("utf-8")}
    except UnicodeDecodeError:
        return {"id": token_id, "piece": list(piece)}


def _llama_token(tokenizer: GGUFTokenizer, token_id: int, logprob: float, post: bool = False) -> dict[str, Any]:
    piece = tokenizer.token_bytes(token_id, skip_special=False)
    out = {"id": token_id, "token": piece.decode("utf-8", errors="replace"), "bytes": list(piece)}
    if post:
        out["prob"] = math.exp(logprob)
    else:
        out["logprob"] = logprob
    return out


def llama_probabilities(tokenizer: GGUFTokenizer, entries: Sequence[TokenLogprob], post: bool = False) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities`: each generated token and its top `n_probs`, as
    log-probabilities of the model's distribution, or with `post` (post_sampling_probs) as
    probabilities of what the sampler drew from (tokens its filters dropped are not listed)."""
    if post:
        return [{**_llama_token(tokenizer, e.token_id, e.logprob, True),
                 "top_probs": [_llama_token(tokenizer, t, lp, True) for t, lp in e.top if lp > -math.inf]} for e in entries]
    return [{**_llama_token(tokenizer, e.token_id, e.logprob), "top_logprobs": [_llama_token(tokenizer, t, lp) for t, lp in e.top]} for e in entries]


def _llama_timings(final: Delta) -> dict[str, Any]:
    u = final.usage or _NO_USAGE
    prompt_n, prompt_ms, predicted_ms = u.prompt_tokens - u.cached_tokens, final.prompt_time_s * 1e3, final.decode_time_s * 1e3
    return {
        "cache_n": u.cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else None, "prompt_per_second": prompt_n / final.prompt_time_s if final.prompt_time_s > 0 else None,
        "predicted_n": u.completion_tokens, "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / u.completion_tokens if u.completion_tokens else None,
        "predicted_per_second": u.completion_tokens / final.decode_time_s if final.decode_time_s > 0 else None,
    }


class LlamaFormatter:
    """llama-server's /completion answers (one choice): the whole one, or streamed events, each
    partial one a token's text, then a last one with the summary and no text, as llama-server
    sends them. `tokens` are listed when streaming or with `return_tokens`, as there."""

    def __init__(self, tokenizer: GGUFTokenizer, model: str, prompt_ids: Sequence[int], settings: dict[str, Any], return_tokens: bool) -> None:
        self.tokenizer, self.model, self.settings, self.return_tokens = tokenizer, model, settings, return_tokens
        self.num_prompt_tokens, self.prompt_text = len(prompt_ids), tokenizer.decode(list(prompt_ids), skip_special=False)
        self.post = bool(settings.get("post_sampling_probs"))
        self._predicted = 0
        self._new_line = False  # a streamed answer's text so far had one

    def _probabilities(self, deltas: Sequence[Delta]) -> dict[str, Any]:
        entries = [e for d in deltas for e in (d.logprobs or ())]
        return {"completion_probabilities": llama_probabilities(self.tokenizer, entries, self.post)} if entries else {}

    def whole(self, deltas: list[Delta], streamed: bool = False) -> dict[str, Any]:
        final = deltas[-1]
        u = final.usage or _NO_USAGE
        content = "".join(d.text for d in deltas)
        return {
            "index": 0, "content": content,
            "tokens": [t for d in deltas for t in d.token_ids] if self.return_tokens else [],
            "id_slot": 0, "stop": True, "model": self.model,
            "tokens_predicted": u.completion_tokens, "tokens_evaluated": u.prompt_tokens,
            "generation_settings": self.settings, "prompt": self.prompt_text, "has_new_line": self._new_line if streamed else "\n" in content,
            "truncated": False, "stop_type": "limit" if final.finish_reason == "length" else "word" if final.stop_word else "eos",
            "stopping_word": final.stop_word or "",
            "tokens_cached": max(0, u.prompt_tokens + u.completion_tokens - 1),  # what the slot holds, as llama-server counts it (n_past)
            "timings": _llama_timings(final),
            **({} if streamed else self._probabilities(deltas)),
        }

    def chunk(self, delta: Delta, first: bool) -> list[dict[str, Any]]:
        out = []
        if delta.token_ids or delta.text:
            self._predicted += len(delta.token_ids)
            self._new_line = self._new_line or "\n" in delta.text
            out.append({"index": 0, "content": delta.text, "tokens": list(delta.token_ids), "stop": False, "id_slot": -1,
                        "tokens_predicted": self._predicted, "tokens_evaluated": self.num_prompt_tokens, **self._probabilities([delta])})
        if delta.is_finished:
            last = replace(delta, token_ids=(), text="", logprobs=None)
            out.append(self.whole([last], streamed=True))
        return out
