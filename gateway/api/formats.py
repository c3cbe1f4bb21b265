"""Response bodies: OpenAI completions and chat (whole and streamed chunks) and
llama-server's /completion, built from the worker's `Delta`s (torch-free)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from worker.contract.calls import Delta, TokenLogprob, Usage
from worker.formats.tokenizer import GGUFTokenizer

_NO_USAGE = Usage(0, 0, 0)


def token_str(tokenizer: GGUFTokenizer, token_id: int) -> str:
    return tokenizer.token_bytes(token_id, skip_special=False).decode("utf-8", errors="replace")


def usage(final: Delta) -> dict[str, Any]:
    u = final.usage or _NO_USAGE
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def sse(data: dict[str, Any] | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def finish_reason(reason: str | None) -> str | None:
    return {"stop": "stop", "length": "length"}.get(reason or "", None if reason is None else "stop")


class CompletionFormatter:
    """`text_completion` objects; with `echo`, the prompt's text (and log-probabilities) lead."""

    def __init__(self, tokenizer: GGUFTokenizer, model: str, prompt_ids: list[int], echo: bool, logprobs: int | None) -> None:
        self.tokenizer, self.model, self.prompt_ids, self.echo, self.k = tokenizer, model, prompt_ids, echo, logprobs
        self.id, self.created = f"cmpl-{time.time_ns():x}", int(time.time())
        self._offset = 0

    def _logprobs(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, token_id in enumerate(ids):
            entry = entries[i] if i < len(entries) else None
            text = token_str(self.tokenizer, token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            out["top_logprobs"].append(None if entry is None else {token_str(self.tokenizer, t): lp for t, lp in entry.top})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out

    def _generated(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        return self._logprobs([e.token_id for e in entries], entries)

    def prompt_text(self) -> str:
        return self.tokenizer.decode(self.prompt_ids) if self.echo else ""

    def _merge(self, a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
        return b if a is None else {k: a[k] + b[k] for k in a}

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        final = deltas[-1]
        text = self.prompt_text() + "".join(d.text for d in deltas)
        logprobs = None
        if self.k is not None:
            if self.echo:
                logprobs = self._logprobs(self.prompt_ids, final.prompt_logprobs or ())
            for d in deltas:
                if d.logprobs:
                    logprobs = self._merge(logprobs, self._generated(d.logprobs))
            logprobs = logprobs or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(final.finish_reason)}],
            "usage": usage(final),
        }

    def chunk(self, delta: Delta, first: bool) -> dict[str, Any]:
        text = (self.prompt_text() if first else "") + delta.text
        logprobs = self._generated(delta.logprobs) if self.k is not None and delta.logprobs else None
        return {
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(delta.finish_reason)}],
        }

    def usage_chunk(self, final: Delta) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [], "usage": usage(final)}


class ChatFormatter:
    def __init__(self, tokenizer: GGUFTokenizer, model: str, logprobs: int | None) -> None:
        self.tokenizer, self.model, self.k = tokenizer, model, logprobs
        self.id, self.created = f"chatcmpl-{time.time_ns():x}", int(time.time())

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        data = self.tokenizer.token_bytes(token_id, skip_special=False)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        if self.k is None:
            return None
        content = []
        for d in deltas:
            for e in d.logprobs or ():
                content.append({**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in e.top]})
        return {"content": content}

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        final = deltas[-1]
        message = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        return {
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "message": message, "logprobs": self._logprobs(deltas), "finish_reason": finish_reason(final.finish_reason)}],
            "usage": usage(final),
        }

    def chunk(self, delta: Delta, first: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": body, "logprobs": self._logprobs([delta]), "finish_reason": finish_reason(delta.finish_reason)}],
        }

    def usage_chunk(self, final: Delta) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model, "choices": [], "usage": usage(final)}


def tokenize_piece(tokenizer: GGUFTokenizer, token_id: int) -> dict[str, Any]:
    """llama-server's /tokenize piece: text when it is valid UTF-8, else its bytes."""
    piece = tokenizer.token_bytes(token_id, skip_special=False)
    try:
        return {"id": token_id, "piece": piece.decode("utf-8")}
    except UnicodeDecodeError:
        return {"id": token_id, "piece": list(piece)}


def _llama_token(tokenizer: GGUFTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    piece = tokenizer.token_bytes(token_id, skip_special=False)
    return {"id": token_id, "token": piece.decode("utf-8", errors="replace"), "bytes": list(piece), "logprob": logprob}


def llama_probabilities(tokenizer: GGUFTokenizer, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities`: each generated token and its top `n_probs`."""
    return [{**_llama_token(tokenizer, e.token_id, e.logprob), "top_logprobs": [_llama_token(tokenizer, t, lp) for t, lp in e.top]} for e in entries]


def llama_completion(deltas: list[Delta], model: str, tokenizer: GGUFTokenizer | None = None, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """llama-server's /completion answer (the fields its clients and tests read)."""
    final = deltas[-1]
    u = final.usage or _NO_USAGE
    out = {
        "index": 0, "id_slot": 0,
        "content": "".join(d.text for d in deltas),
        "tokens": [t for d in deltas for t in d.token_ids],
        "model": model, "stop": True,
        "stop_type": "limit" if final.finish_reason == "length" else "word" if final.stop_word else "eos",
        "stopping_word": final.stop_word or "", "truncated": False,
        "tokens_predicted": u.completion_tokens, "tokens_evaluated": u.prompt_tokens, "tokens_cached": u.cached_tokens,
        "timings": {
            "prompt_n": u.prompt_tokens - u.cached_tokens, "prompt_ms": final.prompt_time_s * 1e3,
            "predicted_n": u.completion_tokens, "predicted_ms": final.decode_time_s * 1e3,
            "predicted_per_second": u.completion_tokens / final.decode_time_s if final.decode_time_s > 0 else None,
        },
    }
    if settings is not None:
        out["generation_settings"] = settings
    entries = [e for d in deltas for e in (d.logprobs or ())]
    if tokenizer is not None and entries:
        out["completion_probabilities"] = llama_probabilities(tokenizer, entries)
    return out
