"""llama-server's response bodies (torch-free): `/completion` answers, whole or streamed, with
their `completion_probabilities`, and `/tokenize` pieces."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from gateway.http.formatting import NO_USAGE, PromptProgress, TokenTimings, llama_timings
from worker.contract.calls import Delta, TokenLogprob
from worker.formats.tokenizer import GGUFTokenizer


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


def llama_probabilities(tokenizer: GGUFTokenizer, entries: Sequence[TokenLogprob],
                        post: bool = False) -> list[dict[str, Any]]:
    """llama-server's `completion_probabilities`: each generated token and its top `n_probs`, as
    log-probabilities of the model's distribution, or with `post` (post_sampling_probs) as
    probabilities of what the sampler drew from (tokens its filters dropped are not listed)."""
    if post:
        return [{**_llama_token(tokenizer, e.token_id, e.logprob, True),
                 "top_probs": [_llama_token(tokenizer, t, lp, True) for t, lp in e.top if lp > -math.inf]}
                for e in entries]
    return [{**_llama_token(tokenizer, e.token_id, e.logprob),
             "top_logprobs": [_llama_token(tokenizer, t, lp) for t, lp in e.top]} for e in entries]


def selected_fields(answer: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama-server's `response_fields`: only the answer's fields at these paths ("a/b" reads field b
    of field a), each under its path as it was given; paths that lead nowhere are left out."""
    out = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


class LlamaFormatter:
    """llama-server's /completion answers (one choice): the whole one, or streamed events, each
    partial one a token's text, then a last one with the summary and no text, as llama-server
    sends them. `tokens` are listed when streaming or with `return_tokens`, as there. `index` is
    the prompt's place in a batch; `response_fields` keeps only those fields of the summary
    (llama-server's paths); `progress` opens the stream with `prompt_progress` events, and
    `timings` puts llama-server's `timings` on each streamed token's event (`timings_per_token`)."""

    def __init__(self, tokenizer: GGUFTokenizer, model: str, prompt_ids: Sequence[int], settings: dict[str, Any],
                 return_tokens: bool, index: int = 0, response_fields: Sequence[str] = (),
                 progress: PromptProgress | None = None, timings: TokenTimings | None = None) -> None:
        self.tokenizer, self.model, self.settings, self.return_tokens = tokenizer, model, settings, return_tokens
        self.index, self.response_fields, self.progress, self.timings = index, list(response_fields), progress, timings
        self.num_prompt_tokens = len(prompt_ids)
        self.prompt_text = tokenizer.decode(list(prompt_ids), skip_special=False)
        self.post = bool(settings.get("post_sampling_probs"))
        self._predicted = 0
        self._new_line = False  # a streamed answer's text so far had one

    def _probabilities(self, deltas: Sequence[Delta]) -> dict[str, Any]:
        entries = [e for d in deltas for e in (d.logprobs or ())]
        return {"completion_probabilities": llama_probabilities(self.tokenizer, entries, self.post)} if entries else {}

    def whole(self, deltas: list[Delta], streamed: bool = False) -> dict[str, Any]:
        final = deltas[-1]
        u = final.usage or NO_USAGE
        content = "".join(d.text for d in deltas)
        answer = {
            "index": self.index, "content": content,
            "tokens": [t for d in deltas for t in d.token_ids] if self.return_tokens else [],
            "id_slot": 0, "stop": True, "model": self.model,
            "tokens_predicted": u.completion_tokens, "tokens_evaluated": u.prompt_tokens,
            "generation_settings": self.settings, "prompt": self.prompt_text,
            "has_new_line": self._new_line if streamed else "\n" in content,
            "truncated": False,
            "stop_type": "limit" if final.finish_reason == "length" else "word" if final.stop_word else "eos",
            "stopping_word": final.stop_word or "",
            # what the slot holds, as llama-server counts it (n_past)
            "tokens_cached": max(0, u.prompt_tokens + u.completion_tokens - 1),
            "timings": llama_timings(final),
            **({} if streamed else self._probabilities(deltas)),
        }
        return selected_fields(answer, self.response_fields) if self.response_fields else answer

    def _partial(self, text: str, token_ids: Sequence[int]) -> dict[str, Any]:
        return {"index": self.index, "content": text, "tokens": list(token_ids), "stop": False, "id_slot": -1,
                "tokens_predicted": self._predicted, "tokens_evaluated": self.num_prompt_tokens}

    def chunk(self, delta: Delta, first: bool) -> list[dict[str, Any]]:
        out = []
        if first and self.progress is not None:
            out += [{**self._partial("", ()), "prompt_progress": p} for p in self.progress.events(delta)]
        if delta.token_ids or delta.text:
            self._predicted += len(delta.token_ids)
            self._new_line = self._new_line or "\n" in delta.text
            timings = {"timings": self.timings.of(delta)} if self.timings is not None else {}
            out.append({**self._partial(delta.text, delta.token_ids), **self._probabilities([delta]), **timings})
        if delta.is_finished:
            last = replace(delta, token_ids=(), text="", logprobs=None)
            out.append(self.whole([last], streamed=True))
        return out
