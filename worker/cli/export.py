"""`loraplex export-lora`: a base GGUF with adapters merged in (worker/formats/export_lora.py)."""

from __future__ import annotations

import argparse
import sys

from worker.formats.adapter import AdapterError
from worker.formats.export_lora import ExportError, export_merged
from worker.formats.gguf_file import GGUFFormatError

EXIT_INVALID = 2


def run(args: argparse.Namespace) -> int:
    try:
        report = export_merged(args.model, args.lora, args.output, args.outtype)
    except (AdapterError, ExportError, GGUFFormatError, OSError) as e:
        print(f"loraplex export-lora: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(f"wrote {args.output}: {len(report.merged)} tensors merged from {len(args.lora)} adapter(s), outtype {args.outtype}")
    if report.untied_output:
        print("output.weight added: the base's output projection was tied to the merged token embedding, and keeps the unmerged one")
    if report.ignored:
        print(f"ignored (not matrices, as at runtime): {', '.join(sorted(set(report.ignored)))}")
    if report.fallbacks:
        print(f"written as F16 (gguf cannot quantize the base's type): {', '.join(report.fallbacks)}")
    return 0
