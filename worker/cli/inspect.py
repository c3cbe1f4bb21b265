"""`loraplex inspect`: metadata, tensor table, fingerprint and validation of a GGUF file."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np

from worker.formats.adapter import AdapterError, load_adapter
from worker.formats.fingerprint import base_fingerprint
from worker.formats.gguf_file import GGUFFile, GGUFFormatError, MetadataValue
from worker.formats.hparams import ModelHParams, UnsupportedModelError

EXIT_INVALID = 2
_MAX_SHOWN = 8


def _show_value(entry: MetadataValue) -> Any:
    value = entry.value
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list) and len(value) > _MAX_SHOWN:
        return {"length": len(value), "first": value[:_MAX_SHOWN]}
    if isinstance(value, str) and len(value) > 200:
        return value[:200] + f"... ({len(value)} chars)"
    return value


def describe(path: str, base_path: str | None) -> dict[str, Any]:
    """Everything inspect prints; raises AdapterError / GGUFFormatError when invalid."""
    gguf = GGUFFile(path)
    info: dict[str, Any] = {
        "file": path,
        "gguf_version": gguf.version,
        "type": gguf.get("general.type", "model"),
        "architecture": gguf.get("general.architecture"),
        "metadata": {k: _show_value(v) for k, v in gguf.metadata.items()},
        "tensors": [{"name": t.name, "type": t.type.name, "shape": list(t.shape)} for t in gguf.tensors.values()],
    }
    if info["type"] == "adapter" or base_path is not None:
        base = GGUFFile(base_path) if base_path else None
        adapter = load_adapter(path, base)
        info["fingerprint"] = adapter.fingerprint
        info["adapter"] = {
            "alpha": adapter.alpha,
            "ranks": sorted({p.rank for p in adapter.pairs.values()}),
            "targets": list(adapter.pairs),
            "skipped_tensors": list(adapter.skipped_tensors),
            "task_name": adapter.task_name,
            "prompt_prefix": adapter.prompt_prefix,
            "alora_invocation_tokens": list(adapter.invocation_tokens) if adapter.invocation_tokens else None,
            "dora": adapter.is_dora,
            "chat_template": adapter.chat_template,
            "num_bytes": adapter.num_bytes,
        }
        info["validation"] = f"valid for base {base_path}" if base_path else "valid on its own (pass --base to check it against a model)"
    else:
        info["fingerprint"] = base_fingerprint(gguf)
        try:
            hp = ModelHParams.from_gguf(gguf)
            info["hparams"] = {k: (v.value if hasattr(v, "value") else v) for k, v in vars(hp).items()}
        except UnsupportedModelError as e:
            info["hparams"] = None
            info["unsupported"] = str(e)
    return info


def _row(label: str, value: Any) -> None:
    print(f"{label + ':':<26}{value}")


def _print_text(info: dict[str, Any]) -> None:
    _row("file", f"{info['file']}  (GGUF v{info['gguf_version']})")
    _row("type", f"{info['type']}   architecture: {info['architecture']}")
    _row("fingerprint", info["fingerprint"])
    for key, value in info.get("adapter", {}).items():
        if key == "chat_template":
            _row(key, f"{len(value)} characters (adapter.chat_template; --json shows it)" if value else None)
        elif key != "targets":
            _row(key, value)
    if info.get("hparams"):
        _row("hparams", ", ".join(f"{k}={v}" for k, v in info["hparams"].items()))
    if info.get("unsupported"):
        _row("unsupported", info["unsupported"])
    print("metadata:")
    for key, value in info["metadata"].items():
        print(f"  {key} = {value}")
    print(f"tensors ({len(info['tensors'])}):")
    for t in info["tensors"]:
        print(f"  {t['name']:<40} {t['type']:<6} {t['shape']}")
    if "validation" in info:
        _row("validation", info["validation"])


def run(args: argparse.Namespace) -> int:
    try:
        info = describe(args.file, args.base)
    except AdapterError as e:
        print(f"loraplex inspect: invalid adapter {args.file}: {e.message}", file=sys.stderr)
        return EXIT_INVALID
    except GGUFFormatError as e:
        print(f"loraplex inspect: {e}", file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        json.dump(info, sys.stdout, indent=1, default=str)
        print()
    else:
        _print_text(info)
    return 0
