"""Minimal safetensors reader on numpy, with bfloat16 kept as raw bits (torch-free)."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_NUMPY = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8"}


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class StoredTensor:
    dtype: str  # safetensors dtype name: F32, F16, BF16, F64
    data: np.ndarray  # BF16 as uint16 bit patterns

    def to_float32(self) -> np.ndarray:
        if self.dtype == "BF16":
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        return self.data.astype(np.float32)


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, StoredTensor]:
    raw = Path(path).read_bytes()
    if len(raw) < 8:
        raise SafetensorsError(f"{path}: too short to be a safetensors file")
    (header_len,) = struct.unpack("<Q", raw[:8])
    try:
        header = json.loads(raw[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: unreadable safetensors header") from e
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry.get("dtype")
        if dtype not in _NUMPY:
            raise SafetensorsError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        start, end = entry["data_offsets"]
        if base + end > len(raw):
            raise SafetensorsError(f"{path}: tensor '{name}' data is outside the file")
        data = np.frombuffer(raw, dtype=_NUMPY[dtype], count=(end - start) // np.dtype(_NUMPY[dtype]).itemsize, offset=base + start)
        tensors[name] = StoredTensor(dtype, data.reshape(entry["shape"]))
    return tensors

