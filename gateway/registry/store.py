"""Adapter files as they come in (torch-free): what a tenant sends is checked against the
base with llama.cpp's rules (docs/architecture.md#adapters-we-read, the same messages) and converted when it is PEFT; the
registry then keeps it under its fingerprint in the adapter store (cache/blobs.py), where
every worker can fetch it. A server-side path (vLLM's `lora_path`) is read only under the
directories the operator allows (`registry.allowed_paths`) and, for a tenant's key, under its
own `adapter_paths` too; any other, through `..` or a symlink included, is refused without
saying what is there.
"""

from __future__ import annotations

import os
from pathlib import Path

from worker.formats.adapter import AdapterError, LoRAAdapter, load_adapter
from worker.formats.chat_template import ChatTemplate, ChatTemplateError
from worker.formats.gguf_file import GGUFFile, GGUFFormatError
from worker.formats.hparams import UnsupportedModelError
from worker.formats.peft_convert import ConversionError, ConvertOptions, convert_peft_to_gguf
from worker.formats.peft_template import TEMPLATE_FILE, TOKENIZER_CONFIG
from worker.formats.safetensors_file import SafetensorsError
from worker.formats.tokenizer import TokenizerError

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_TEMPLATE_FILES = (TOKENIZER_CONFIG, TEMPLATE_FILE)  # optional beside them: the adapter's own chat template
INVALID = (AdapterError, GGUFFormatError, ConversionError, SafetensorsError, UnsupportedModelError, TokenizerError,
           UnicodeDecodeError)


class InvalidAdapter(ValueError):
    """The file is no adapter for this base; the message says why (llama.cpp's words)."""


class PathNotAllowed(PermissionError):
    """A server-side path outside the allowed directories (the message names no file)."""


def _scrub(message: str, *paths: Path) -> str:
    """A message without the server's paths in it."""
    for path in paths:
        message = message.replace(str(path), path.name)
    return message


def check_gguf(path: Path, base: GGUFFile) -> LoRAAdapter:
    """The adapter in `path`, validated against `base` (its own chat template must compile);
    InvalidAdapter with the reason."""
    try:
        adapter = load_adapter(path, base)
    except INVALID as e:
        raise InvalidAdapter(_scrub(str(e), path)) from e
    except (OSError, ValueError) as e:  # a truncated or garbled file
        raise InvalidAdapter(_scrub(f"not a GGUF adapter file: {e}", path)) from e
    if adapter.chat_template is not None:
        try:
            ChatTemplate(adapter.chat_template)  # a check only: renders compile it with the model's BOS and EOS
        except ChatTemplateError as e:
            raise InvalidAdapter(f"adapter.chat_template: {e}") from e
    return adapter


def convert_peft(directory: Path, base: GGUFFile, out: Path) -> LoRAAdapter:
    """A PEFT adapter (adapter_config.json + adapter_model.safetensors in `directory`) as a
    GGUF adapter at `out`, checked as an uploaded GGUF would be."""
    try:
        convert_peft_to_gguf(directory, base.path, out, ConvertOptions())
    except INVALID as e:
        raise InvalidAdapter(_scrub(str(e), directory / PEFT_CONFIG, directory / PEFT_WEIGHTS, directory, out,
                                    base.path)) from e
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise InvalidAdapter(_scrub(f"not a PEFT LoRA adapter: {e}", directory / PEFT_CONFIG, directory / PEFT_WEIGHTS,
                                    directory, out, base.path)) from e
    adapter = check_gguf(out, base)
    if not adapter.pairs:
        raise InvalidAdapter(f"{PEFT_WEIGHTS} holds no LoRA tensors (lora_A/lora_B) for this model")
    return adapter


def _is_under(real: Path, roots: list[Path]) -> bool:
    for root in roots:
        root_real = Path(os.path.realpath(root))
        if real == root_real or root_real in real.parents:
            return True
    return False


def allowed_path(requested: str, roots: list[Path], base_dir: Path, within: list[Path] | None = None) -> Path:
    """`requested` with every symlink resolved, when it lies under one of `roots` and, given
    `within` (a tenant's own directories), under one of those too; else PathNotAllowed."""
    refused = PathNotAllowed("lora_path is not under a directory this server loads adapters from" if within is None
                             else "lora_path is not under a directory this key may load adapters from")
    if not requested or "\0" in requested:
        raise refused
    path = Path(requested).expanduser()
    real = Path(os.path.realpath(path if path.is_absolute() else base_dir / path))
    if _is_under(real, roots) and (within is None or _is_under(real, within)):
        return real
    raise refused


def read_server_path(requested: str, roots: list[Path], base_dir: Path, base: GGUFFile, scratch: Path,
                     within: list[Path] | None = None) -> LoRAAdapter:
    """The adapter at an allowed server path (`allowed_path`): a GGUF file, or a PEFT directory
    (each of its files must resolve under the allowed directories too)."""
    path = allowed_path(requested, roots, base_dir, within)
    if path.is_file():
        return check_gguf(path, base)
    if path.is_dir() and (path / PEFT_CONFIG).is_file():
        for name in (PEFT_CONFIG, PEFT_WEIGHTS, *(n for n in PEFT_TEMPLATE_FILES if (path / n).exists())):
            allowed_path(str(path / name), roots, base_dir, within)  # a symlink inside pointing out is refused too
        return convert_peft(path, base, scratch / "converted.gguf")
    raise FileNotFoundError("lora_path names no GGUF adapter file and no PEFT adapter directory")
