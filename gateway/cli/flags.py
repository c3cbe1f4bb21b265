"""Argument types and flag groups that several commands share."""

from __future__ import annotations

import argparse
import math

from worker.contract.spec import DTYPES, WEIGHT_FORMATS, DeviceSettings

# the object `ArgumentParser.add_subparsers()` returns; every command registers on it
Subparsers = argparse._SubParsersAction

WEIGHTS_HELP = ("weight format: auto = f16 on CPU (quantized GGUF weights as float16, fp32 math), dense elsewhere; "
                "q4 = CPU int4 kernel with bfloat16 activations (fastest, not llama.cpp-exact)")


def token_ids(text: str) -> list[int]:
    """`1,2,3` -> [1, 2, 3]."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from e
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must not be negative, got {text!r}")
    return ids


def lora_spec(text: str) -> tuple[str, float]:
    """`PATH` or `PATH:SCALE` -> (path, scale), scale 1 by default. A path may hold colons itself, so
    only a numeric last part is a scale; a scale that is not a finite number is refused."""
    path, sep, scale_text = text.rpartition(":")
    if not sep:
        return text, 1.0
    try:
        scale = float(scale_text)
    except ValueError:
        return text, 1.0  # a ':' that belongs to the path
    if not math.isfinite(scale):
        raise argparse.ArgumentTypeError(f"adapter scale must be a finite number, got {scale_text!r}")
    return path, scale


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def decode_threads(text: str) -> int | str:
    if text == "auto":
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")


def device_flags(p: argparse.ArgumentParser, what: str = "torch device, e.g. cpu, cuda, cuda:1") -> None:
    """--device, --dtype, --threads, --weights and --decode-threads; `device_settings` checks them after parsing."""
    defaults = DeviceSettings()
    p.add_argument("--device", default=defaults.device, help=what)
    p.add_argument("--dtype", default=defaults.dtype, choices=DTYPES,
                   help="compute dtype (default float32, as llama.cpp's activations)")
    p.add_argument("--threads", type=positive_int, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--weights", default=defaults.weights, choices=WEIGHT_FORMATS, help=WEIGHTS_HELP)
    p.add_argument("--decode-threads", type=decode_threads, metavar="N|auto",
                   help="of those, what a pass that only decodes uses: a count, or auto (measured); default all")
    p.set_defaults(device_settings=None)


def device_settings(args: argparse.Namespace) -> DeviceSettings:
    """The device flags as one checked `DeviceSettings` (ValueError if they do not go together);
    torch checks the device itself later, in the handler."""
    return DeviceSettings(device=args.device, dtype=args.dtype, weights=args.weights,
                          threads=args.threads, decode_threads=args.decode_threads)
