"""Content fingerprints (SPEC §3): base model, adapter, adapter set.

Every field is written as tag, type code and length-prefixed payload, so two
different tuples never serialize to the same bytes. Digests are BLAKE2b-256,
stable across processes and machines. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from worker.formats.gguf_file import GGUFFile, MetadataValue

FINGERPRINT_VERSION = 1


def _jsonable(value: object) -> object:
    if isinstance(value, np.ndarray):  # arrays nested in arrays
        return value.tolist()
    raise TypeError(f"cannot hash metadata value of type {type(value).__name__}")


class TaggedHasher:
    """BLAKE2b over tagged, length-prefixed fields."""

    def __init__(self, domain: str) -> None:
        self._h = hashlib.blake2b(digest_size=32)
        self.text("domain", domain)
        self.integer("version", FINGERPRINT_VERSION)

    def _field(self, tag: str, kind: bytes, payload: bytes | memoryview) -> None:
        tag_bytes = tag.encode("utf-8")
        self._h.update(struct.pack("<Q", len(tag_bytes)) + tag_bytes + kind + struct.pack("<Q", len(payload)))
        self._h.update(payload)

    def text(self, tag: str, value: str) -> None:
        self._field(tag, b"s", value.encode("utf-8"))

    def integer(self, tag: str, value: int) -> None:
        self._field(tag, b"i", str(int(value)).encode("ascii"))

    def real(self, tag: str, value: float) -> None:
        value = float(value)
        self._field(tag, b"f", struct.pack("<d", 0.0 if value == 0.0 else value))

    def raw(self, tag: str, value: bytes | memoryview) -> None:
        self._field(tag, b"b", value)

    def metadata(self, tag: str, value: MetadataValue) -> None:
        if isinstance(value.value, np.ndarray):
            payload = value.value.tobytes()
        else:
            payload = json.dumps(value.value, ensure_ascii=False, default=_jsonable).encode("utf-8")
        self._field(f"{tag}:{int(value.type)}:{value.element_type}", b"m", payload)

    def digest_bytes(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _hash_tensors(h: TaggedHasher, gguf: GGUFFile, names: Iterable[str]) -> None:
    for name in names:
        info = gguf.tensors[name]
        h.text("tensor", name)
        h.integer("type", int(info.type))
        h.text("shape", ",".join(map(str, info.shape)))
        h.raw("data", gguf.raw_bytes(info))


def base_fingerprint_uncached(gguf: GGUFFile) -> str:
    arch = gguf.get("general.architecture", "")
    h = TaggedHasher("loraplex.base")
    h.text("arch", arch)
    for key in sorted(k for k in gguf.metadata if k.startswith(f"{arch}.")):
        h.metadata(key, gguf.metadata[key])
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
        disk_file = cache_dir / f"base-{name}.txt"
        if disk_file.is_file():
            _memo[memo_key] = disk_file.read_text().strip()
            return _memo[memo_key]
    digest = base_fingerprint_uncached(gguf)
    _memo[memo_key] = digest
    if disk_file is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = disk_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(disk_file)
    return digest


def adapter_fingerprint(gguf: GGUFFile, alpha: float, invocation_tokens: tuple[int, ...] | None) -> str:
    """Fingerprint of an adapter: content only, never its path or name."""
    h = TaggedHasher("loraplex.adapter")
    h.text("arch", str(gguf.get("general.architecture", "")))
    h.real("alpha", alpha)
    if invocation_tokens is None:
        h.text("invocation", "none")
    else:
        h.text("invocation", ",".join(map(str, invocation_tokens)))
    names = sorted(n for n in gguf.tensors if n.endswith((".lora_a", ".lora_b")))
    _hash_tensors(h, gguf, names)
    return h.hexdigest()


def adapter_set_fingerprint(base_fp: str, adapters: Iterable[tuple[str, float]]) -> str:
    """Fingerprint of (base, {adapter: scale}); order-free, scale-0 entries drop out."""
    h = TaggedHasher("loraplex.adapter_set")
    h.text("base", base_fp)
    active = sorted((fp, float(scale)) for fp, scale in adapters if float(scale) != 0.0)
    h.integer("count", len(active))
    for fp, scale in active:
        h.text("adapter", fp)
        h.real("scale", scale)
    return h.hexdigest()
