"""Tagged, length-prefixed hashing: the primitive under fingerprints and cache keys (torch-free).

Every field is written as tag, type code and length-prefixed payload, so two
different tuples never serialize to the same bytes. A hasher starts with its
domain and the version its user owns, so bumping one kind of hash (adapter
fingerprints, cache keys) never changes another.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np

from worker.formats.gguf_file import MetadataValue


def _jsonable(value: object) -> object:
    if isinstance(value, np.ndarray):  # arrays nested in arrays
        return value.tolist()
    raise TypeError(f"cannot hash metadata value of type {type(value).__name__}")


class TaggedHasher:
    """BLAKE2b over tagged, length-prefixed fields."""

    def __init__(self, domain: str, version: int) -> None:
        self._h = hashlib.blake2b(digest_size=32)
        self.text("domain", domain)
        self.integer("version", version)

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
