"""Render a GGUF's `tokenizer.chat_template` with sandboxed jinja2 (torch-free)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages or the template cannot be rendered."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _message_text(content: Any) -> str:
    """OpenAI content: a string, or a list of parts of which text parts are kept."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"unsupported message content part of type {part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatTemplateError("message content must be a string or a list of text parts")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               allow_empty: bool = False, **extra: Any) -> str:
        if not messages and not allow_empty:
            raise ChatTemplateError("messages must not be empty")
        clean = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if not isinstance(role, str) or not role:
                raise ChatTemplateError(f"messages[{i}] has no role")
            clean.append({**message, "role": role, "content": _message_text(message.get("content", ""))})
        try:
            return self._template.render(
                messages=clean,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError
            raise ChatTemplateError(f"chat template failed: {e}") from e


def literal_spans(text: str, contents: Sequence[str | tuple[str, ...]], has_control_text: Callable[[str], bool]) -> list[tuple[int, int]]:
    """Where in the rendered `text` the message contents that hold control-token text lie
    (every occurrence, or of the content with its outer whitespace trimmed, as templates
    often trim it; a tuple is one text in the forms a template may write it, e.g. raw and
    JSON-escaped). Contents without control-token text need no protection."""
    spans = []
    for content in contents:
        forms = content if isinstance(content, tuple) else (content,)
        if not has_control_text(forms[0]):
            continue
        found = []
        for candidate in dict.fromkeys(f for form in forms for f in (form, form.strip())):
            start = text.find(candidate)
            while candidate and start >= 0:
                found.append((start, start + len(candidate)))
                start = text.find(candidate, start + len(candidate))
            if found:
                break
        if not found:
            raise ChatTemplateError(
                "a message's content holds control-token text and the chat template changed it: it cannot be kept as text"
            )
        spans += found
    return spans


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], continue_final: bool = False, **extra: Any) -> str:
    """`messages` rendered with the model's template (a `GGUFTokenizer`'s), the generation prompt
    added unless `add_generation_prompt=False`; `extra` goes to the template too (`tools`). With
    `continue_final`, the last message (the assistant's) is a prefill, as llama-server renders one:
    the messages before it with the generation prompt, then its text, left open."""
    if not tokenizer.chat_template:
        raise ChatTemplateError("this model has no chat template (tokenizer.chat_template)")
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    template = ChatTemplate(tokenizer.chat_template, bos, eos)
    if not continue_final:
        return template.render(messages, **extra)
    extra.pop("add_generation_prompt", None)
    head = template.render(messages[:-1], add_generation_prompt=True, allow_empty=True, **extra)
    return head + _message_text(messages[-1].get("content") or "")


def strings_in(value: Any, skip: frozenset[str] = frozenset()) -> list[str]:
    """Every string in a JSON-like value (keys included), but under the keys in `skip`."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() if k not in skip for s in [*strings_in(k), *strings_in(v)]]
    if isinstance(value, Sequence):
        return [s for v in value for s in strings_in(v)]
    return []


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], continue_final: bool = False, **extra: Any) -> list[int]:
    """Render `messages` with the model's template and tokenize (a `GGUFTokenizer`), as
    llama-server does, except that control tokens come only from the template: text in a
    message's content that spells one (`<|im_start|>`) stays text, and so does every other
    string the template is given (tool definitions, earlier calls' names and arguments), raw
    or JSON-escaped. `continue_final`: the last message is a prefill (render_chat)."""
    text = render_chat(tokenizer, messages, continue_final, **extra)
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    contents: list[str | tuple[str, ...]] = [_message_text(m.get("content", "")) for m in messages]
    contents += [
        (s, json.dumps(s, ensure_ascii=False)[1:-1])
        for s in strings_in([extra, [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]])
    ]
    spans = literal_spans(text, contents, tokenizer.has_control_text)
    # a template that writes the BOS itself must not get a second one
    add_special = not (tokenizer.add_bos and bos and text.startswith(bos))
    return tokenizer.encode(text, add_special=add_special, parse_special=True, literal_spans=spans)
