"""Response bodies: OpenAI completions and chat (whole and streamed chunks, n choices each), built
from the worker's `Delta`s (torch-free); llama-server's are in gateway/api/llama/formats.py."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from gateway.http.formatting import PromptProgress, TokenTimings, by_choice, llama_timings, summary, token_str, usage
from gateway.reasoning import NO_REASONING, ReasoningCounter, ReasoningPlan
from gateway.tool_calls import ToolCall, ToolPlan, ToolReader
from worker.contract.calls import Delta, TokenLogprob
from worker.formats.tokenizer import GGUFTokenizer

SYSTEM_FINGERPRINT = "fp_loraplex"


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
        self.tokenizer, self.model, self.prompt_ids, self.echo = tokenizer, model, prompt_ids, echo
        self.k, self.keep = logprobs, keep
        self.id, self.created = f"cmpl-{time.time_ns():x}", int(time.time())
        self._offsets: dict[int, int] = {}  # per choice, streamed text so far

    def _logprobs(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None],
                  offset: int) -> tuple[dict[str, Any], int]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, token_id in enumerate(ids):
            entry = entries[i] if i < len(entries) else None
            text = token_str(self.tokenizer, token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if entry is None else entry.logprob)
            top = None if entry is None else {token_str(self.tokenizer, t): lp for t, lp in entry.top}
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out, offset

    def prompt_text(self) -> str:
        return self.tokenizer.decode(self.prompt_ids) if self.echo else ""

    def _choice(self, index: int, deltas: list[Delta],
                prompt_logprobs: Sequence[TokenLogprob | None] | None) -> dict[str, Any]:
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
        # computed once, by choice 0
        prompt_logprobs = next((d.prompt_logprobs for d in finals if d.prompt_logprobs), None)
        if self.keep is not None:
            groups = sorted(groups, key=_mean_logprob, reverse=True)[: self.keep]
        return {
            **self._head(),
            "choices": [self._choice(i, group, prompt_logprobs) for i, group in enumerate(groups)],
            "usage": usage(finals), "timings": llama_timings(summary(finals)),
        }

    def chunk(self, delta: Delta, first: bool) -> dict[str, Any]:
        text = (self.prompt_text() if first else "") + delta.text
        logprobs = None
        if self.k is not None and delta.logprobs:
            logprobs, self._offsets[delta.index] = self._logprobs([e.token_id for e in delta.logprobs], delta.logprobs,
                                                                  self._offsets.get(delta.index, 0))
        choice = {"index": delta.index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason(delta.finish_reason)}
        return {**self._head(), "choices": [choice]}

    def usage_chunk(self, finals: Sequence[Delta]) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": usage(finals), "timings": llama_timings(summary(finals))}

    def _head(self) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}


class ChatFormatter:
    """`chat.completion` objects; with `tools`, each choice's text is read for tool calls
    (gateway/tool_calls.py): whole, or streamed as calls complete. A streamed choice opens with
    `{"role": "assistant", "content": null}` and no text, and ends with a chunk holding only its
    finish_reason and an empty delta, as OpenAI and llama-server stream them; with `progress`,
    choice 0 opens with llama-server's `prompt_progress` chunks instead. With a `reasoning` plan
    that splits, each choice's thinking is its `reasoning_content` (whole, or deltas of their own),
    and only the answer after it is content and read for tool calls. With `timings`, a chunk of a
    delta's tokens carries llama-server's `timings` so far (`timings_per_token`)."""

    def __init__(self, tokenizer: GGUFTokenizer, model: str, logprobs: int | None,
                 tools: ToolPlan | None = None, progress: PromptProgress | None = None,
                 reasoning: ReasoningPlan = NO_REASONING, timings: TokenTimings | None = None) -> None:
        self.tokenizer, self.model, self.k, self.tools, self.progress = tokenizer, model, logprobs, tools, progress
        self.timings = timings
        self.reasoning = reasoning
        self.id, self.created = f"chatcmpl-{time.time_ns():x}", int(time.time())
        self._readers: dict[int, ToolReader] = {}  # per choice, when streaming with tools
        self._counters: dict[int, ReasoningCounter] = {}  # per choice: its thinking split off, its tokens counted

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        data = self.tokenizer.token_bytes(token_id, skip_special=False)
        token = data.decode("utf-8", errors="replace")
        return {"id": token_id, "token": token, "logprob": logprob, "bytes": list(data)}  # id: llama-server's

    def _logprobs(self, deltas: list[Delta]) -> dict[str, Any] | None:
        if self.k is None:
            return None
        content = []
        for d in deltas:
            for e in d.logprobs or ():
                top = [self._entry(t, lp) for t, lp in e.top]
                content.append({**self._entry(e.token_id, e.logprob), "top_logprobs": top})
        return {"content": content}

    def _finish_reason(self, delta: Delta, called: bool) -> str | None:
        reason = finish_reason(delta.finish_reason)
        return "tool_calls" if called and reason == "stop" else reason

    def _split(self, delta: Delta) -> tuple[str, str]:
        """The (reasoning, content) `delta` adds to its choice."""
        counter = self._counters.setdefault(delta.index, ReasoningCounter(self.reasoning))
        return counter.feed(delta.text, len(delta.token_ids), delta.finish_reason is not None)

    def _usage(self, finals: Sequence[Delta]) -> dict[str, Any]:
        num_reasoning = sum(c.num_reasoning_tokens for c in self._counters.values())
        return {**usage(finals), "completion_tokens_details": {"reasoning_tokens": num_reasoning}}

    def _choice(self, index: int, deltas: list[Delta]) -> dict[str, Any]:
        pieces = [self._split(d) for d in deltas]
        text = "".join(content for _, content in pieces)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._counters[index].has_reasoning:
            message["reasoning_content"] = "".join(reasoning for reasoning, _ in pieces)
        calls: list[ToolCall] = []
        if self.tools is not None:
            message["content"], calls = self.tools.parse(text)
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(deltas),
                "finish_reason": self._finish_reason(deltas[-1], bool(calls))}

    def whole(self, deltas: list[Delta]) -> dict[str, Any]:
        groups = by_choice(deltas)
        finals = [group[-1] for group in groups.values()]
        return {
            **self._head("chat.completion"),
            "choices": [self._choice(i, group) for i, group in groups.items()],
            "usage": self._usage(finals), "timings": llama_timings(summary(finals)),
        }

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": SYSTEM_FINGERPRINT}

    def _chunk(self, index: int, body: dict[str, Any], logprobs: dict[str, Any] | None = None,
               reason: str | None = None) -> dict[str, Any]:
        return {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": index, "delta": body, "logprobs": logprobs, "finish_reason": reason}],
        }

    def chunk(self, delta: Delta, first: bool) -> list[dict[str, Any]]:
        chunks = self._opening(delta) if first else []
        reasoning, text = self._split(delta)
        if self.tools is None:
            events: list[str | dict[str, Any]] = [text] if text else []
            called = False
        else:
            reader = self._readers.setdefault(delta.index, self.tools.reader())
            events = reader.feed(text) + (reader.finish() if delta.finish_reason is not None else [])
            called = reader.num_calls > 0
        bodies = [{"reasoning_content": reasoning}] if reasoning else []
        bodies += [{"content": e} if isinstance(e, str) else {"tool_calls": [e]} for e in events]
        logprobs = self._logprobs([delta]) if delta.logprobs else None
        if logprobs is not None and not bodies:
            bodies = [{"content": ""}]  # the tokens' log-probabilities come with a chunk of their own
        timings = self.timings.of(delta) if self.timings is not None and delta.token_ids else None
        chunks += [{**self._chunk(delta.index, body, logprobs if i == 0 else None),
                    **({"timings": timings} if timings is not None and i == 0 else {})} for i, body in enumerate(bodies)]
        if delta.finish_reason is not None:
            chunks.append(self._chunk(delta.index, {}, None, self._finish_reason(delta, called)))
        return chunks

    def _opening(self, delta: Delta) -> list[dict[str, Any]]:
        """A choice's first chunks: its role, with no text (and with `progress`, choice 0's prompt_progress)."""
        role = {"role": "assistant", "content": None}
        if self.progress is None or delta.index != 0:
            return [self._chunk(delta.index, role)]
        return [{**self._chunk(delta.index, role), "prompt_progress": p} for p in self.progress.events(delta)]

    def usage_chunk(self, finals: Sequence[Delta]) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": self._usage(finals),
                "timings": llama_timings(summary(finals))}
