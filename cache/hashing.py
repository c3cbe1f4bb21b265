"""Tagged, length-prefixed hashing: the primitive under the prefix cache's keys (cache/keys.py) and
the content fingerprints (worker/formats/fingerprint.py). Torch-free, and no numpy.

Every field is written as tag, type code and length-prefixed payload, so two
different tuples never serialize to the same bytes. A hasher starts with its
domain and the version its user owns, so bumping one kind of hash (adapter
fingerprints, cache keys) never changes another.
"""

from __future__ import annotations

import hashlib
import struct


class TaggedHasher:
    """BLAKE2b over tagged, length-prefixed fields."""

    def __init__(self, domain: str, version: int) -> None:
        self._h = hashlib.blake2b(digest_size=32)
        self.text("domain", domain)
        self.integer("version", version)

    def field(self, tag: str, kind: bytes, payload: bytes | memoryview) -> None:
        """One field: `kind` is its one-byte type code (s, i, f and b are this class's own; a caller
        hashing values of its own kind picks another)."""
        tag_bytes = tag.encode("utf-8")
        self._h.update(struct.pack("<Q", len(tag_bytes)) + tag_bytes + kind + struct.pack("<Q", len(payload)))
        self._h.update(payload)

    def text(self, tag: str, value: str) -> None:
        self.field(tag, b"s", value.encode("utf-8"))

    def integer(self, tag: str, value: int) -> None:
        self.field(tag, b"i", str(int(value)).encode("ascii"))

    def real(self, tag: str, value: float) -> None:
        value = float(value)
        self.field(tag, b"f", struct.pack("<d", 0.0 if value == 0.0 else value))

    def raw(self, tag: str, value: bytes | memoryview) -> None:
        self.field(tag, b"b", value)

    def digest_bytes(self) -> bytes:
        return self._h.digest()

    def hexdigest(self) -> str:
        return self._h.hexdigest()
