"""Chat templates from GGUF rendered in a jinja2 sandbox."""

from __future__ import annotations

import pytest

from worker.formats.chat_template import ChatTemplate, ChatTemplateError


def test_smollm2_template_adds_default_system_prompt(real_tokenizer) -> None:
    template = ChatTemplate(real_tokenizer.chat_template)
    text = template.render([{"role": "user", "content": "What is the capital of France?"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_content_parts_are_joined() -> None:
    template = ChatTemplate("{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}")
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert template.render([{"role": "user", "content": parts}]) == "[user:ab]"
    with pytest.raises(ChatTemplateError, match="image_url"):
        template.render([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_raise_exception_from_template() -> None:
    template = ChatTemplate("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}")
    with pytest.raises(ChatTemplateError, match="system first"):
        template.render([{"role": "user", "content": "x"}])


def test_bad_messages_and_bad_template() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    template = ChatTemplate("{{ messages }}")
    with pytest.raises(ChatTemplateError, match="empty"):
        template.render([])
    with pytest.raises(ChatTemplateError, match="no role"):
        template.render([{"content": "x"}])
