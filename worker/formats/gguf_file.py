"""Read GGUF files: metadata, tensor table and lazily loaded tensor data.

Torch-free on purpose: the gateway parses adapters and fingerprints them
without loading torch. Tensor data is memory-mapped and dequantized with the
`gguf` package on demand.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file."""


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALAR_FORMATS: dict[ValueType, str] = {
    ValueType.UINT8: "B",
    ValueType.INT8: "b",
    ValueType.UINT16: "H",
    ValueType.INT16: "h",
    ValueType.UINT32: "I",
    ValueType.INT32: "i",
    ValueType.FLOAT32: "f",
    ValueType.BOOL: "?",
    ValueType.UINT64: "Q",
    ValueType.INT64: "q",
    ValueType.FLOAT64: "d",
}
_NUMPY_DTYPES: dict[ValueType, str] = {
    ValueType.UINT8: "<u1",
    ValueType.INT8: "<i1",
    ValueType.UINT16: "<u2",
    ValueType.INT16: "<i2",
    ValueType.UINT32: "<u4",
    ValueType.INT32: "<i4",
    ValueType.FLOAT32: "<f4",
    ValueType.BOOL: "?",
    ValueType.UINT64: "<u8",
    ValueType.INT64: "<i8",
    ValueType.FLOAT64: "<f8",
}


@dataclass(frozen=True)
class MetadataValue:
    """One metadata entry; arrays of numbers are numpy arrays, of strings lists."""

    type: ValueType
    value: Any
    element_type: ValueType | None = None  # set for arrays


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] (ne0) is the contiguous axis
    type: GGMLQuantizationType
    offset: int  # absolute offset of the data in the file
    num_bytes: int

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def ne(self, axis: int) -> int:
        """ggml's ne[axis]; missing trailing axes are 1, as in ggml."""
        return self.shape[axis] if axis < len(self.shape) else 1


def tensor_num_bytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    num_elements = int(np.prod(shape, dtype=np.int64))
    return num_elements // block_size * type_size


@functools.cache
def is_dequantizable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether `gguf` can turn this tensor type into floats (probed on one zero block)."""
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, type_size), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, num_bytes: int) -> memoryview:
        end = self.pos + num_bytes
        if end > len(self.buf):
            raise GGUFFormatError(f"file ends inside the header (needs byte {end}, has {len(self.buf)})")
        out = self.buf[self.pos : end]
        self.pos = end
        return out

    def scalar(self, vtype: ValueType) -> Any:
        fmt = "<" + _SCALAR_FORMATS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar(ValueType.UINT64)
        try:
            return bytes(self.take(length)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"string at byte {self.pos - length} is not UTF-8") from e

    def value_type(self) -> ValueType:
        raw = self.scalar(ValueType.UINT32)
        try:
            return ValueType(raw)
        except ValueError as e:
            raise GGUFFormatError(f"unknown metadata value type {raw}") from e

    def value(self, vtype: ValueType) -> MetadataValue:
        if vtype == ValueType.STRING:
            return MetadataValue(vtype, self.string())
        if vtype != ValueType.ARRAY:
            return MetadataValue(vtype, self.scalar(vtype))
        element_type = self.value_type()
        count = self.scalar(ValueType.UINT64)
        if element_type == ValueType.STRING:
            return MetadataValue(vtype, [self.string() for _ in range(count)], element_type)
        if element_type == ValueType.ARRAY:
            return MetadataValue(vtype, [self.value(self.value_type()).value for _ in range(count)], element_type)
        dtype = np.dtype(_NUMPY_DTYPES[element_type])
        data = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
        return MetadataValue(vtype, data, element_type)


class GGUFFile:
    """A parsed GGUF file. Tensor bytes stay on disk until asked for."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size == 0:
                    raise GGUFFormatError(f"{self.path}: empty file")
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise GGUFFormatError(f"cannot read {self.path}: {e.strerror}") from e
        self.metadata: dict[str, MetadataValue] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            self._parse(memoryview(self._mmap))
        except GGUFFormatError as e:
            raise GGUFFormatError(f"{self.path}: not a valid GGUF file: {e}") from e

    def _parse(self, buf: memoryview) -> None:
        cur = _Cursor(buf)
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise GGUFFormatError("bad magic (expected 'GGUF')")
        self.version = cur.scalar(ValueType.UINT32)
        if self.version not in (2, 3):
            raise GGUFFormatError(f"unsupported GGUF version {self.version} (big-endian or too old?)")
        num_tensors = cur.scalar(ValueType.UINT64)
        num_kv = cur.scalar(ValueType.UINT64)
        for _ in range(num_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.value_type())
        infos = []
        for _ in range(num_tensors):
            name = cur.string()
            num_dims = cur.scalar(ValueType.UINT32)
            if num_dims > 4:
                raise GGUFFormatError(f"tensor '{name}' has {num_dims} dimensions")
            shape = tuple(cur.scalar(ValueType.UINT64) for _ in range(num_dims))
            raw_type = cur.scalar(ValueType.UINT32)
            offset = cur.scalar(ValueType.UINT64)
            try:
                ggml_type = GGMLQuantizationType(raw_type)
            except ValueError as e:
                raise GGUFFormatError(f"tensor '{name}' has unknown type {raw_type}") from e
            infos.append((name, shape, ggml_type, offset))
        alignment = int(self.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment}")
        data_start = (cur.pos + alignment - 1) // alignment * alignment
        for name, shape, ggml_type, offset in infos:
            if name in self.tensors:
                raise GGUFFormatError(f"duplicate tensor name '{name}'")
            self.tensors[name] = TensorInfo(
                name, shape, ggml_type, data_start + offset, tensor_num_bytes(shape, ggml_type)
            )

    def get(self, key: str, default: Any = None) -> Any:
        entry = self.metadata.get(key)
        return default if entry is None else entry.value

    def is_in_bounds(self, info: TensorInfo) -> bool:
        return info.offset + info.num_bytes <= self.file_size

    def raw_bytes(self, info: TensorInfo) -> memoryview:
        """The tensor's bytes as stored."""
        if not self.is_in_bounds(info):
            raise GGUFFormatError(f"{self.path}: tensor '{info.name}' data is not within the file bounds")
        return memoryview(self._mmap)[info.offset : info.offset + info.num_bytes]

    def load(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, numpy axes reversed from ggml's."""
        info = self.tensors[name]
        raw = np.frombuffer(self.raw_bytes(info), dtype=np.uint8)
        shape = tuple(reversed(info.shape))
        if info.type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(shape)
        if not is_dequantizable(info.type):
            raise GGUFFormatError(f"{self.path}: tensor '{name}' has type {info.type.name}, which cannot be dequantized")
        block_size, type_size = GGML_QUANT_SIZES[info.type]
        rows = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
        return dequantize(rows, info.type).reshape(shape)
