"""Prefix-cache values (docs/architecture.md#cache-values), torch-free: K and V of every layer for one chunk.

Layout: magic `LPKV`, a little-endian u32 header length, a JSON header
(format version, model fingerprint, dtype, shape, first position, payload
length), the payload (K then V, C order), and a SHA-256 checksum over
everything before it (SHA-256 rather than BLAKE2b: CPUs hash it in hardware,
twice as fast, and a hit verifies megabytes). Anything that does not parse or verify raises
CorruptValue: the caller counts it, deletes the entry and treats it as a miss.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

from cache.keys import VALUE_FORMAT_VERSION

MAGIC = b"LPKV"
CHECKSUM_BYTES = 32
DTYPES = {"float32": np.float32, "float16": np.float16}  # bfloat16 travels as its raw uint16 bits
_RAW = {"bfloat16": np.uint16}


class CorruptValue(ValueError):
    """A cached value that must not be used."""


@dataclass(frozen=True)
class ChunkKV:
    model_fingerprint: str
    first_position: int
    dtype: str  # float32 | float16 | bfloat16
    k: np.ndarray  # [layers, kv_heads, chunk_tokens, head_dim]
    v: np.ndarray


def _storage_dtype(dtype: str) -> type:
    if dtype in DTYPES:
        return DTYPES[dtype]
    if dtype in _RAW:
        return _RAW[dtype]
    raise ValueError(f"unsupported cache dtype {dtype!r}")


def encode(chunk: ChunkKV) -> bytes:
    storage = _storage_dtype(chunk.dtype)
    if chunk.k.shape != chunk.v.shape or chunk.k.ndim != 4:
        raise ValueError(f"K and V must share a 4-d shape, got {chunk.k.shape} and {chunk.v.shape}")
    k, v = np.ascontiguousarray(chunk.k, dtype=storage), np.ascontiguousarray(chunk.v, dtype=storage)
    header = json.dumps({
        "version": VALUE_FORMAT_VERSION, "model": chunk.model_fingerprint, "dtype": chunk.dtype,
        "shape": list(chunk.k.shape), "first_position": chunk.first_position, "payload_bytes": k.nbytes + v.nbytes,
    }, sort_keys=True).encode()
    body = b"".join((MAGIC, struct.pack("<I", len(header)), header, k.data, v.data))
    return body + hashlib.sha256(body).digest()


def decode(blob: bytes, model_fingerprint: str) -> ChunkKV:
    """The chunk, or CorruptValue when it is truncated, tampered with, or for another model."""
    if len(blob) < len(MAGIC) + 4 + CHECKSUM_BYTES or blob[:4] != MAGIC:
        raise CorruptValue("not a loraplex KV value")
    view = memoryview(blob)  # slices below are views: a value is megabytes, never copied here
    body, checksum = view[:-CHECKSUM_BYTES], view[-CHECKSUM_BYTES:]
    if hashlib.sha256(body).digest() != checksum:
        raise CorruptValue("checksum mismatch")
    (header_len,) = struct.unpack_from("<I", body, 4)
    try:
        header = json.loads(bytes(body[8 : 8 + header_len]))
        storage = _storage_dtype(header["dtype"])
        shape = tuple(int(n) for n in header["shape"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptValue(f"bad header: {e}") from e
    if header.get("version") != VALUE_FORMAT_VERSION:
        raise CorruptValue(f"format version {header.get('version')} is not {VALUE_FORMAT_VERSION}")
    if header.get("model") != model_fingerprint:
        raise CorruptValue("value belongs to another model")
    payload = body[8 + header_len :]
    count = int(np.prod(shape))
    if len(shape) != 4 or len(payload) != header.get("payload_bytes") or len(payload) != 2 * count * np.dtype(storage).itemsize:
        raise CorruptValue("payload length does not match the header")
    data = np.frombuffer(payload, dtype=storage)
    keys, values = data[:count].reshape(shape), data[count:].reshape(shape)
    return ChunkKV(model_fingerprint, int(header["first_position"]), header["dtype"], keys, values)
