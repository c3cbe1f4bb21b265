"""The chat template a PEFT adapter directory ships (torch-free): `chat_template.jinja` beside
`adapter_config.json`, else `tokenizer_config.json`'s `chat_template` (a string, or transformers'
list of named templates, of which the one named `default`). The converter keeps it in the GGUF
adapter as `adapter.chat_template` (worker/formats/adapter.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.formats.adapter import MAX_CHAT_TEMPLATE_CHARS

TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"


class TemplateFileError(ValueError):
    """The directory's template files cannot be read as a chat template."""


def _from_config(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TemplateFileError(f"{path}: chat_template must be a string or a list of named templates with a 'default' one")


def peft_chat_template(peft_dir: Path) -> str | None:
    """The directory's chat template; None when it ships none."""
    template_file, config_file = peft_dir / TEMPLATE_FILE, peft_dir / TOKENIZER_CONFIG
    try:
        if template_file.is_file():
            template: str | None = template_file.read_text(encoding="utf-8")
            path = template_file
        elif config_file.is_file():
            template = _from_config(json.loads(config_file.read_text(encoding="utf-8")).get("chat_template"), config_file)
            path = config_file
        else:
            return None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise TemplateFileError(f"{config_file.name} or {template_file.name} cannot be read: {e}") from e
    if template is not None and len(template) > MAX_CHAT_TEMPLATE_CHARS:
        raise TemplateFileError(f"{path}: the chat template is {len(template)} characters, over {MAX_CHAT_TEMPLATE_CHARS}")
    return template or None
