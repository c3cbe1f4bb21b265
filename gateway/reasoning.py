"""Reasoning ("thinking") in a model's answer (torch-free): which markers a model family writes
its thinking between, how a request turns thinking on or off, and the splitter that separates
the thinking from the answer, whole or as the text streams (a marker may be split across
deltas).

Families, chosen from the model's chat template (`reasoning.parser: auto`) or named in the serve
config (gateway/config.py):
- **qwen3**: the model writes `<think>...</think>` before its answer; the template's
  `enable_thinking` switch, when false, writes an empty think block into the prompt itself.
- **deepseek_r1**: the same markers, but the template opens `<think>` at the end of the prompt,
  so the answer begins inside the thinking. Which of the two a request is in is read from its
  rendered prompt (`opens_thinking`), so one splitter serves both.
A family with other markers is one more `PARSERS` entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ParserName = Literal["auto", "none", "qwen3", "deepseek_r1"]
# OpenAI's reasoning_effort (the openai SDK's ReasoningEffort); "none" turns thinking off, any other on
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
MAX_BUDGET_TOKENS = 1_000_000


class ReasoningSettings(BaseModel):
    """The serve config's `reasoning` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    # auto: from the chat template; none: thinking is never split from the answer
    parser: ParserName = "auto"
    # thinking when a request does not say (llama-server's --reasoning); auto and on: on
    thinking: Literal["auto", "on", "off"] = "auto"

    @property
    def default_thinking(self) -> bool:
        """The `enable_thinking` a template gets when the request does not say: always a bool, as
        llama-server passes it (templates that read `not enable_thinking` need it defined)."""
        return self.thinking != "off"


class ReasoningFields(BaseModel):
    """What a chat body (gateway/api/openai/protocol.py's ChatRequest) asks of reasoning
    (docs/api.md#reasoning); validated as the body is."""

    reasoning_effort: Effort | None = None
    # llama-server's: "none" leaves the thinking in the content; "auto" and "deepseek" split it out
    reasoning_format: Literal["none", "auto", "deepseek"] | None = None
    thinking_budget_tokens: int | None = Field(None, ge=0, le=MAX_BUDGET_TOKENS)  # thinking ends after this many tokens
    reasoning_budget: int | None = Field(None, ge=-1, le=MAX_BUDGET_TOKENS)  # llama-server's name for it; -1: none

    @model_validator(mode="after")
    def _budget_takes_one_choice(self) -> ReasoningFields:
        if self.thinking_budget is not None and getattr(self, "n", 1) > 1:
            raise ValueError("a thinking budget takes n = 1")
        return self

    @property
    def thinking_budget(self) -> int | None:
        """The thinking budget in tokens (thinking_budget_tokens, else reasoning_budget); None: none."""
        if self.thinking_budget_tokens is not None:
            return self.thinking_budget_tokens
        return None if self.reasoning_budget in (None, -1) else self.reasoning_budget


@dataclass(frozen=True)
class ThinkTags:
    """The markers a family writes its thinking between."""

    start: str
    end: str


THINK = ThinkTags("<think>", "</think>")
PARSERS: dict[str, ThinkTags] = {"qwen3": THINK, "deepseek_r1": THINK}


def tags_of(parser: str, chat_template: str | None) -> ThinkTags | None:
    """The markers this deployment splits on: the configured family's, or with `auto` the first
    family whose markers the chat template writes; None: no split."""
    if parser == "none":
        return None
    if parser != "auto":
        return PARSERS[parser]
    template = chat_template or ""
    return next((tags for tags in PARSERS.values() if tags.start in template and tags.end in template), None)


def thinking_asked(enable_thinking: object, reasoning_effort: str | None, default: bool | None = None) -> bool | None:
    """What a request asks of thinking: `chat_template_kwargs.enable_thinking` when it gives a bool,
    else `reasoning_effort` ("none": off; any other effort: on), else the server's `default`; None:
    the template's default."""
    if isinstance(enable_thinking, bool):
        return enable_thinking
    if reasoning_effort is not None:
        return reasoning_effort != "none"
    return default


def opens_thinking(prompt_tail: str, tags: ThinkTags) -> bool:
    """The rendered prompt ends inside a think block (DeepSeek-R1's templates open it), so the
    answer begins with thinking."""
    tail = prompt_tail.rstrip()
    return tail.endswith(tags.start)


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's text split into (reasoning, content) as it streams. Thinking is recognised only
    at the start of the answer (after whitespace), or from the start when `starts_inside`; the
    whitespace around the thinking is dropped, as is the answer's leading whitespace after it.
    Text that may be the start of a marker is held back until the next piece tells."""

    def __init__(self, tags: ThinkTags, starts_inside: bool = False) -> None:
        self.tags = tags
        self.state = "thinking_head" if starts_inside else "start"
        self.has_reasoning = starts_inside
        self._buffer = ""

    @property
    def is_answering(self) -> bool:
        """The thinking (if any) is over."""
        return self.state in ("answer_head", "answer")

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that `text` adds."""
        self._buffer += text
        reasoning, content = "", ""
        while True:
            buffer = self._buffer
            if self.state == "start":
                head = buffer.lstrip()
                if head.startswith(self.tags.start):
                    self._buffer, self.state, self.has_reasoning = head[len(self.tags.start):], "thinking_head", True
                    continue
                if self.tags.start.startswith(head):  # empty, or a marker's beginning: wait
                    break
                self.state = "answer"
            elif self.state in ("thinking_head", "answer_head"):
                self._buffer = buffer.lstrip()
                if not self._buffer:
                    break
                self.state = "thinking" if self.state == "thinking_head" else "answer"
            elif self.state == "thinking":
                at = buffer.find(self.tags.end)
                if at >= 0:
                    reasoning += buffer[:at].rstrip()
                    self._buffer, self.state = buffer[at + len(self.tags.end):], "answer_head"
                    continue
                keep = _held_back(buffer, self.tags.end)
                said = buffer[: len(buffer) - keep].rstrip()  # trailing whitespace waits: it may precede the end
                reasoning += said
                self._buffer = buffer[len(said):]
                break
            else:
                content, self._buffer = content + buffer, ""
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the text is over: unfinished thinking is reasoning."""
        buffer, self._buffer = self._buffer, ""
        if self.state == "thinking":
            return buffer.rstrip(), ""
        if self.state == "start":
            return "", buffer
        return "", ""


def split_reasoning(text: str, tags: ThinkTags, starts_inside: bool = False) -> tuple[str | None, str]:
    """A whole answer's (reasoning, content); reasoning None when it holds no thinking."""
    splitter = ReasoningSplitter(tags, starts_inside)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.has_reasoning else None), content + more_content


@dataclass(frozen=True)
class ReasoningPlan:
    """One request's reasoning: its model's thinking markers (None: it has none), whether its answer
    begins inside thinking, its thinking budget in tokens, whether the answer is split (`is_split`
    false: the thinking stays in the content, llama-server's `reasoning_format: none`), and whether
    the model may think (`may_think` false: the request turned thinking off)."""

    tags: ThinkTags | None
    starts_inside: bool = False
    budget_tokens: int | None = None
    is_split: bool = True
    may_think: bool = True

    def splitter(self) -> ReasoningSplitter | None:
        """A splitter of one choice's answer; None when it is not split."""
        if self.tags is None or not self.is_split:
            return None
        return ReasoningSplitter(self.tags, self.starts_inside)


NO_REASONING = ReasoningPlan(None)


class ReasoningCounter:
    """A choice's splitter that also counts its reasoning tokens: a delta's tokens count when they
    came before the thinking ended (the end marker's own included) and added no content."""

    def __init__(self, plan: ReasoningPlan) -> None:
        self.splitter = plan.splitter()
        self.num_reasoning_tokens = 0

    def feed(self, text: str, num_tokens: int, is_last: bool) -> tuple[str, str]:
        if self.splitter is None:
            return "", text
        was_answering = self.splitter.is_answering
        reasoning, content = self.splitter.feed(text)
        if is_last:
            more_reasoning, more_content = self.splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.splitter.has_reasoning and not was_answering and not content:
            self.num_reasoning_tokens += num_tokens
        return reasoning, content

    @property
    def has_reasoning(self) -> bool:
        return self.splitter is not None and self.splitter.has_reasoning


def after_thinking(grammar: str, tags: ThinkTags, starts_inside: bool, end_lexeme: str | None = None) -> str:
    """`grammar` (an llguidance grammar: its JSON form, or Lark text) bound to the answer only: the
    thinking before it is free text up to the end marker, and is where the answer begins when
    `starts_inside` (the prompt opened it), else an optional prefix the model may write.
    `end_lexeme`: the end marker in Lark when the tokenizer holds it as a special token (`<[id]>`,
    which text can never match); None: the marker as text."""
    if grammar.lstrip().startswith("{"):
        subs = [dict(g) for g in json.loads(grammar)["grammars"]]
    else:
        subs = [{"lark_grammar": grammar}]
    subs[0].setdefault("name", "answer")
    head = "thought" if starts_inside else f"({json.dumps(tags.start)} thought)?"
    if end_lexeme is None:  # one lazy lexeme: the thought ends at the first end marker
        thought = f"thought: thought_text BLANK?\nthought_text[lazy]: /(?s:.*)/ {json.dumps(tags.end)}\n"
    else:  # text cannot hold a special token: the thought is all text before it
        thought = f"thought: THOUGHT_TEXT {end_lexeme} BLANK?\nTHOUGHT_TEXT: /(?s:.*)/\n"
    lark = f"%llguidance {{}}\nstart: {head} @{subs[0]['name']}\n{thought}BLANK: /[ \\t\\r\\n]+/\n"
    return json.dumps({"grammars": [{"name": "after_thinking", "lark_grammar": lark}, *subs]})
