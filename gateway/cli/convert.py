"""`loraplex convert-lora`: a PEFT LoRA adapter as a llama.cpp GGUF adapter (worker/cli/convert.py)."""

from __future__ import annotations

from gateway.cli.flags import Subparsers, token_ids


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("convert-lora", help="convert a PEFT LoRA adapter to a llama.cpp GGUF adapter")
    p.add_argument("peft_dir", metavar="PEFT_DIR")
    p.add_argument("--base", required=True, metavar="BASE.gguf", help="the GGUF base model the adapter is for")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf")
    p.add_argument("--alpha", type=float, help="use this lora_alpha instead of adapter_config.json's")
    inv = p.add_mutually_exclusive_group()
    inv.add_argument("--invocation-string", metavar="S",
                     help="make an aLoRA invoked by this text (tokenized with the base's tokenizer)")
    inv.add_argument("--invocation-tokens", metavar="1,2", type=token_ids,
                     help="make an aLoRA invoked by these token ids")
    p.add_argument("--task-name", help="adapter.lora.task_name metadata")
    p.add_argument("--prompt-prefix", help="adapter.lora.prompt_prefix metadata")
    p.add_argument("--chat-template", metavar="FILE",
                   help="keep this chat template in the adapter (default: PEFT_DIR's chat_template.jinja or "
                        "tokenizer_config.json's, if any)")
    p.add_argument("--outtype", default="auto", choices=["auto", "f32", "f16", "bf16"],
                   help="tensor type (auto keeps the PEFT file's)")
    p.set_defaults(handler="worker.cli.convert:run")
