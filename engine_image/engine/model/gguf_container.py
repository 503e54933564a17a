"""The GGUF container: a file's metadata as Python values and its tensors as views of a
memory map, read in one pass.

The gguf package's GGUFReader makes a numpy view per metadata string (SmolLM2's 49,152
tokens and 48,900 merges: ~4 s per load, most of an engine's start). The format is
small, so it is read here with `struct` in tens of milliseconds; the gguf package still
names the tensor types and dequantises them. Layout (little-endian, versions 2 and 3):

    "GGUF" | version u32 | tensor count u64 | metadata count u64
    metadata: key (string), value type u32, value
    tensor infos: name (string), n_dims u32, dims u64 * n_dims, type u32, offset u64
    padding to `general.alignment` (32), then the tensors' bytes at their offsets

A string is a u64 byte length and UTF-8 bytes; an array is an item type u32, a u64
count and the items.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# Value type -> struct format of one item (the fixed-size types).
_SCALARS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
# Tensor types stored as plain numbers; every other type is blocks of bytes.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file."""

    name: str
    tensor_type: GGMLQuantizationType
    # ggml's dims, fastest first (ne[0] is the row length): torch's shape reversed.
    shape: tuple[int, ...]
    # Its stored size in bytes.
    n_bytes: int
    # A read-only view of its bytes in the memory map: plain types as numbers shaped
    # like torch's weight, block types as uint8 [rows..., bytes per row] (as the gguf
    # package's dequantize takes them).
    data: np.ndarray


# GGUFContainer.field's default for a key the file must have.
REQUIRED = object()


@dataclass(frozen=True)
class GGUFContainer:
    """A GGUF file's metadata and tensors."""

    version: int
    # Metadata key -> value: int, float, bool, str, or a list of them (arrays).
    fields: dict[str, Any]
    tensors: list[GGUFTensor]

    def field(self, key: str, default: Any = REQUIRED) -> Any:
        """Metadata `key`'s value, `default` where the file has none (ValueError when
        it is REQUIRED)."""
        if key in self.fields:
            return self.fields[key]
        if default is REQUIRED:
            raise ValueError(f"GGUF metadata has no {key!r}")
        return default

    @classmethod
    def read(cls, path: Path) -> GGUFContainer:
        """The container at `path`; ValueError naming what is wrong with a bad file."""
        data = np.memmap(path, mode="r")
        cursor = _Cursor(memoryview(data))
        if cursor.take(4) != _MAGIC:
            raise ValueError("no GGUF magic at the start")
        version = cursor.scalar("I")
        if version not in _VERSIONS:
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise ValueError(f"GGUF version {version} is not supported{hint}; known: 2, 3")
        tensor_count, field_count = cursor.scalar("Q"), cursor.scalar("Q")
        fields: dict[str, Any] = {}
        for _ in range(field_count):
            key = cursor.string()
            fields[key] = cursor.value(cursor.scalar("I"))
        infos = [cursor.tensor_info() for _ in range(tensor_count)]
        alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-cursor.offset // alignment) * alignment
        tensors, names = [], set()
        for name, dims, kind, offset in infos:
            if name in names:
                raise ValueError(f"tensor {name!r} appears twice")
            names.add(name)
            tensors.append(_tensor(data, name, dims, kind, start + offset))
        return cls(version=version, fields=fields, tensors=tensors)


def _tensor(
    data: np.ndarray, name: str, dims: tuple[int, ...], kind: int, offset: int
) -> GGUFTensor:
    try:
        tensor_type = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown type {kind}") from None
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    elements = math.prod(dims)
    if not dims:
        raise ValueError(f"tensor {name!r} has no dimensions")
    if dims[0] % block:
        raise ValueError(f"tensor {name!r}: rows of {dims[0]} are not whole {block}-blocks")
    n_bytes = elements * block_bytes // block
    if offset + n_bytes > data.size:
        raise ValueError(f"tensor {name!r} ends past the end of the file")
    shape = tuple(reversed(dims))
    raw = data[offset : offset + n_bytes]
    plain = _PLAIN.get(tensor_type)
    if plain is not None:
        view = raw.view(plain).reshape(shape)
    else:
        view = raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)
    return GGUFTensor(name, tensor_type, dims, n_bytes, view)


class _Cursor:
    """Reads the header's items in order from a buffer."""

    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def take(self, size: int) -> bytes:
        end = self.offset + size
        if end > len(self.buffer):
            raise ValueError(f"the file ends inside its header (at byte {len(self.buffer)})")
        chunk = bytes(self.buffer[self.offset : end])
        self.offset = end
        return chunk

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.buffer):
            raise ValueError(f"the file ends inside its header (at byte {len(self.buffer)})")
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"a string at byte {self.offset - len(raw)} is not UTF-8") from err

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            fmt = _SCALARS.get(item_kind)
            if fmt is None:  # strings or nested arrays, item by item
                return [self.value(item_kind) for _ in range(count)]
            size = struct.calcsize("<" + fmt) * count
            if self.offset + size > len(self.buffer):
                raise ValueError(f"an array of {count} items runs past the end of the file")
            items = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.offset)
            self.offset += size
            return list(items)
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.offset - 4}")
        return self.scalar(fmt)

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        dims = tuple(self.scalar("Q") for _ in range(self.scalar("I")))
        return name, dims, self.scalar("I"), self.scalar("Q")
