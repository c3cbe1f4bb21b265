"""`loraplex export-lora`: a base GGUF with adapters merged into its weights (worker/cli/export.py)."""

from __future__ import annotations

from gateway.cli.flags import Subparsers, lora_spec


def add_parser(sub: Subparsers) -> None:
    p = sub.add_parser("export-lora", help="write a base GGUF with LoRA adapters merged into its weights")
    p.add_argument("--model", "-m", required=True, metavar="BASE.gguf")
    p.add_argument("--lora", required=True, action="append", type=lora_spec, metavar="PATH[:SCALE]",
                   help="an adapter to merge (repeatable; scale 1 by default)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.gguf")
    p.add_argument("--outtype", default="f16", choices=["f16", "f32", "same"],
                   help="type of the merged tensors (same: the base's where gguf can quantize it, else F16); "
                        "the others keep their bytes")
    p.set_defaults(handler="worker.cli.export:run")
