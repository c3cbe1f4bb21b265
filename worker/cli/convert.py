"""`loraplex convert-lora`: PEFT adapter directory -> llama.cpp GGUF adapter."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.formats.adapter import AdapterError, load_adapter
from worker.formats.gguf_file import GGUFFile, GGUFFormatError
from worker.formats.hparams import UnsupportedModelError
from worker.formats.peft_convert import ConversionError, ConvertOptions, convert_peft_to_gguf
from worker.formats.safetensors_file import SafetensorsError
from worker.formats.tokenizer import TokenizerError

EXIT_INVALID = 2


def run(args: argparse.Namespace) -> int:
    try:
        chat_template = Path(args.chat_template).read_text(encoding="utf-8") if args.chat_template else None
    except (OSError, UnicodeDecodeError) as e:
        print(f"loraplex convert-lora: --chat-template: {e}", file=sys.stderr)
        return EXIT_INVALID
    options = ConvertOptions(
        alpha=args.alpha,
        invocation_tokens=tuple(args.invocation_tokens) if args.invocation_tokens else None,
        invocation_string=args.invocation_string,
        task_name=args.task_name,
        prompt_prefix=args.prompt_prefix,
        outtype=args.outtype,
        chat_template=chat_template,
    )
    try:
        targets = convert_peft_to_gguf(args.peft_dir, args.base, args.output, options)
        adapter = load_adapter(args.output, GGUFFile(args.base))  # what we wrote must load
    except (ConversionError, SafetensorsError, GGUFFormatError, UnsupportedModelError, AdapterError, TokenizerError, OSError) as e:
        print(f"loraplex convert-lora: {e}", file=sys.stderr)
        return EXIT_INVALID
    ranks = sorted({p.rank for p in adapter.pairs.values()})
    print(f"wrote {args.output}: {len(targets)} targets, rank {ranks}, alpha {adapter.alpha:g}, fingerprint {adapter.fingerprint}")
    if adapter.invocation_tokens:
        print(f"aLoRA invocation tokens: {list(adapter.invocation_tokens)}")
    if adapter.chat_template:
        print(f"chat template: {len(adapter.chat_template)} characters (adapter.chat_template)")
    return 0
