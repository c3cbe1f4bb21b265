"""Render a chat template (a GGUF's `tokenizer.chat_template`, an adapter's, a request's) in a
bounded jinja2 sandbox (worker/formats/template_sandbox.py; torch-free)."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2

from worker.formats.template_sandbox import BoundedSandbox, budget

RENDER_TIME_LIMIT_S = 5.0
MAX_RENDERED_CHARS = 8 << 20  # a render's output, and any value it makes, unless the caller bounds it tighter
# what the renderer itself passes a template: extra template variables (`template_kwargs`) may not name them
RESERVED_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


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


def checked_kwargs(template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra template variables, as a dict; ChatTemplateError for a name the renderer sets itself."""
    kwargs = dict(template_kwargs or {})
    taken = sorted(RESERVED_NAMES.intersection(kwargs))
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs: {taken[0]!r} is set by the server, not a template argument")
    return kwargs


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.add_filter("tojson", _tojson)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            with budget(RENDER_TIME_LIMIT_S, MAX_RENDERED_CHARS):  # jinja folds constant filters as it compiles
                self._template = env.from_string(source)
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:
            raise ChatTemplateError(f"the chat template does not compile: {e}") from e
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, *,
               allow_empty: bool = False, max_chars: int = MAX_RENDERED_CHARS,
               time_limit_s: float = RENDER_TIME_LIMIT_S, template_kwargs: Mapping[str, Any] | None = None,
               **extra: Any) -> str:
        """The template's text for `messages`; `extra` (`tools`) and `template_kwargs` (a request's
        `chat_template_kwargs`, which may not name what the renderer sets) are more template variables.
        ChatTemplateError when it fails, runs past `time_limit_s` or makes more than `max_chars`."""
        if not messages and not allow_empty:
            raise ChatTemplateError("messages must not be empty")
        clean = []
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if not isinstance(role, str) or not role:
                raise ChatTemplateError(f"messages[{i}] has no role")
            clean.append({**message, "role": role, "content": _message_text(message.get("content", ""))})
        variables = {**checked_kwargs(template_kwargs), **extra, "messages": clean, "add_generation_prompt": add_generation_prompt,
                     "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            with budget(time_limit_s, max_chars) as bounds:
                return _joined(self._template.generate(**variables), bounds.check_output)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes the sandbox's SecurityError and its budget's RenderLimitError
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except RecursionError as e:
            raise ChatTemplateError("chat template failed: it recurses too deeply") from e
        except (TypeError, ValueError, ArithmeticError, LookupError, MemoryError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _joined(chunks: Any, check_output: Callable[[int], None]) -> str:
    """The rendered chunks, stopped as soon as they pass the budget's size."""
    out, num_chars = [], 0
    for chunk in chunks:
        num_chars += len(chunk)
        check_output(num_chars)
        out.append(chunk)
    return "".join(out)


@functools.lru_cache(maxsize=32)
def compiled(source: str, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
    """A template compiled once for every render of it (the base's, each adapter's, a request's again)."""
    return ChatTemplate(source, bos_token, eos_token)


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


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], continue_final: bool = False, *,
                template: str | None = None, template_kwargs: Mapping[str, Any] | None = None,
                max_chars: int = MAX_RENDERED_CHARS, **extra: Any) -> str:
    """`messages` rendered with `template` (None: the model's, a `GGUFTokenizer`'s), the generation
    prompt added unless `add_generation_prompt=False`; `extra` goes to the template too (`tools`), and
    so do `template_kwargs` (a request's `chat_template_kwargs`, e.g. `enable_thinking`), which may
    not name what the renderer sets. With `continue_final`, the last message (the assistant's) is a
    prefill, as llama-server renders one: the messages before it with the generation prompt, then its
    text, left open. At most `max_chars` of output."""
    source = template if template is not None else tokenizer.chat_template
    if not source:
        raise ChatTemplateError("this model has no chat template (tokenizer.chat_template)")
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
    compiled_template = compiled(source, bos, eos)
    variables = {**extra, "template_kwargs": template_kwargs, "max_chars": max_chars}
    if not continue_final:
        return compiled_template.render(messages, **variables)
    variables.pop("add_generation_prompt", None)
    head = compiled_template.render(messages[:-1], add_generation_prompt=True, allow_empty=True, **variables)
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


def encode_chat(tokenizer, messages: Sequence[Mapping[str, Any]], continue_final: bool = False, *,
                template: str | None = None, template_kwargs: Mapping[str, Any] | None = None,
                max_chars: int = MAX_RENDERED_CHARS, **extra: Any) -> list[int]:
    """Render `messages` with the model's template and tokenize (a `GGUFTokenizer`), as
    llama-server does, except that control tokens come only from the template: text in a
    message's content that spells one (`<|im_start|>`) stays text, and so does every other
    string the template is given (tool definitions, earlier calls' names and arguments), raw
    or JSON-escaped (`template_kwargs` included). `continue_final`, `template`, `template_kwargs`,
    `max_chars`: as render_chat's."""
    text = render_chat(tokenizer, messages, continue_final, template=template, template_kwargs=template_kwargs,
                       max_chars=max_chars, **extra)
    bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
    contents: list[str | tuple[str, ...]] = [_message_text(m.get("content", "")) for m in messages]
    contents += [
        (s, json.dumps(s, ensure_ascii=False)[1:-1])
        for s in strings_in([extra, dict(template_kwargs or {}),
                             [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]])
    ]
    spans = literal_spans(text, contents, tokenizer.has_control_text)
    # a template that writes the BOS itself must not get a second one
    add_special = not (tokenizer.add_bos and bos and text.startswith(bos))
    return tokenizer.encode(text, add_special=add_special, parse_special=True, literal_spans=spans)
