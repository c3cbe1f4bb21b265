"""Content fingerprints: base model, adapter, adapter set. Torch-free.

A fingerprint names content, not a path or a name: two files with the same
tensors and facts are one fingerprint, and a changed file is a new one. Digests
are BLAKE2b-256 over tagged, length-prefixed fields (cache/hashing.py),
stable across processes and machines. `FINGERPRINT_VERSION` is theirs alone:
the prefix cache's keys carry their own version (cache/keys.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from cache.hashing import TaggedHasher
from worker.formats.gguf_file import GGUFFile, MetadataValue

log = logging.getLogger(__name__)

FINGERPRINT_VERSION = 1


def _jsonable(value: object) -> object:
    if isinstance(value, np.ndarray):  # arrays nested in arrays
        return value.tolist()
    raise TypeError(f"cannot hash metadata value of type {type(value).__name__}")


def _hash_metadata(h: TaggedHasher, tag: str, value: MetadataValue) -> None:
    """A GGUF metadata value: its type codes in the tag, an array's bytes or the JSON of anything else."""
    if isinstance(value.value, np.ndarray):
        payload = value.value.tobytes()
    else:
        payload = json.dumps(value.value, ensure_ascii=False, default=_jsonable).encode("utf-8")
    h.field(f"{tag}:{int(value.type)}:{value.element_type}", b"m", payload)


def _hash_tensors(h: TaggedHasher, gguf: GGUFFile, names: Iterable[str]) -> None:
    for name in names:
        info = gguf.tensors[name]
        h.text("tensor", name)
        h.integer("type", int(info.type))
        h.text("shape", ",".join(map(str, info.shape)))
        h.raw("data", gguf.raw_bytes(info))


def base_fingerprint_uncached(gguf: GGUFFile) -> str:
    arch = gguf.get("general.architecture", "")
    h = TaggedHasher("loraplex.base", FINGERPRINT_VERSION)
    h.text("arch", arch)
    for key in sorted(k for k in gguf.metadata if k.startswith(f"{arch}.")):
        _hash_metadata(h, key, gguf.metadata[key])
    _hash_tensors(h, gguf, sorted(gguf.tensors))
    return h.hexdigest()


_memo: dict[tuple[str, int, int], str] = {}


def base_fingerprint(gguf: GGUFFile, cache_dir: Path | None = None) -> str:
    """Fingerprint of a base model, memoized by (path, size, mtime).

    With `cache_dir`, the result also persists on disk so that other processes
    (every worker of a deployment) skip re-hashing a multi-GB file.
    """
    stat = os.stat(gguf.path)
    memo_key = (str(gguf.path.resolve()), stat.st_size, stat.st_mtime_ns)
    if memo_key in _memo:
        return _memo[memo_key]
    disk_file = None
    if cache_dir is not None:
        name = hashlib.blake2b(repr(memo_key).encode(), digest_size=16).hexdigest()
        disk_file = Path(cache_dir) / f"base-{name}.txt"
        stored = _read_digest(disk_file)
        if stored is not None:
            _memo[memo_key] = stored
            return stored
    digest = base_fingerprint_uncached(gguf)
    _memo[memo_key] = digest
    if disk_file is not None:
        try:
            disk_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = disk_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(digest)
            tmp.replace(disk_file)
        except OSError as e:  # a read-only or full disk only costs the next process a re-hash
            log.warning("could not keep the base fingerprint in %s: %s", disk_file, e)
    return digest


def _read_digest(path: Path) -> str | None:
    """A stored digest, or None when there is none or it is not one (then it is computed again)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return text if re.fullmatch(r"[0-9a-f]{64}", text) else None


def adapter_fingerprint(gguf: GGUFFile, alpha: float, invocation_tokens: tuple[int, ...] | None, is_dora: bool = False,
                        chat_template: str | None = None) -> str:
    """Fingerprint of an adapter: content only, never its path or name. A DoRA adapter's
    flag and magnitudes (`.lora_m`) are hashed too, and an adapter's own chat template (one file,
    one fingerprint: the same weights with another template are another adapter); a plain LoRA
    without a template has neither in its digest."""
    h = TaggedHasher("loraplex.adapter", FINGERPRINT_VERSION)
    h.text("arch", str(gguf.get("general.architecture", "")))
    h.real("alpha", alpha)
    if invocation_tokens is None:
        h.text("invocation", "none")
    else:
        h.text("invocation", ",".join(map(str, invocation_tokens)))
    if is_dora:
        h.text("dora", "true")
    if chat_template is not None:
        h.text("chat_template", chat_template)
    names = sorted(n for n in gguf.tensors if n.endswith((".lora_a", ".lora_b", ".lora_m") if is_dora else (".lora_a", ".lora_b")))
    _hash_tensors(h, gguf, names)
    return h.hexdigest()


def adapter_set_fingerprint(base_fp: str, adapters: Iterable[tuple[str, float]]) -> str:
    """Fingerprint of (base, {adapter: scale}); order-free, scale-0 entries drop out."""
    h = TaggedHasher("loraplex.adapter_set", FINGERPRINT_VERSION)
    h.text("base", base_fp)
    active = sorted((fp, float(scale)) for fp, scale in adapters if float(scale) != 0.0)
    h.integer("count", len(active))
    for fp, scale in active:
        h.text("adapter", fp)
        h.real("scale", scale)
    return h.hexdigest()
