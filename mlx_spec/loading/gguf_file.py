"""A GGUF file's metadata and tensor index, parsed with `struct` and read in bulk.

The `gguf` package's `GGUFReader` builds a NumPy view for every value of every field: on the
embedded Gemma 3 270M, whose vocabulary is 262,144 tokens with a score and a type each,
that is ~800,000 views and ~13 s of a first run's ~27 s. Here a numeric array is one
`numpy.frombuffer`, a string array one loop over byte slices; the result is what
`GGUFReader` gives (`field.contents()` for every field, the same tensors), checked against
it in tests/loading/test_gguf_file.py. Tensor data is not read (see `gguf_tensors`).

Layout (little-endian; version 2 and 3): magic "GGUF", version u32, tensor count u64, field
count u64; each field a key (u64 length + UTF-8), a value type u32 and the value (an array:
item type u32, count u64, items); each tensor a name, dimension count u32, dimensions u64
(innermost first), GGML type u32, offset u64 from the data start, which is the end of the
index rounded up to `general.alignment` (default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

# GGUF value type -> struct format of one scalar (8 is STRING, 9 is ARRAY)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_NUMPY = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    """What `GGUFReader.tensors` holds about a tensor, less its data."""
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as stored: innermost dimension first
    data_offset: int  # from the start of the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFFile:
    metadata: dict  # key -> value as GGUFReader's field.contents() gives it (str, number, list)
    tensors: list[GGUFTensor]
    alignment: int


class _Cursor:
    def __init__(self, data):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise ValueError("the file ends inside its header")
        value = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return value[0] if len(value) == 1 else value

    def raw_string(self) -> bytes:
        length = self.take("<Q")
        if self.at + length > len(self.data):
            raise ValueError("the file ends inside its header")
        value = self.data[self.at:self.at + length]
        self.at += length
        return value

    def value(self, kind: int):
        """(value, decodes): a string that is not UTF-8 keeps its place in the stream but is
        reported undecodable, as GGUFReader's contents() raises on it."""
        if kind == _STRING:
            raw = self.raw_string()
            try:
                return raw.decode("utf-8"), True
            except UnicodeDecodeError:
                return None, False
        if kind in _SCALARS:
            return self.take("<" + _SCALARS[kind]), True
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self.take("<I"), self.take("<Q")
        if item_kind in _NUMPY:  # one read for the whole array
            import numpy as np

            size = count * np.dtype(_NUMPY[item_kind]).itemsize
            if self.at + size > len(self.data):
                raise ValueError("the file ends inside its header")
            values = np.frombuffer(self.data, _NUMPY[item_kind], count, self.at).tolist()
            self.at += size
            return values, True
        values, decodes = [], True
        for _ in range(count):  # strings (a vocabulary) or nested arrays, flattened as GGUFReader does
            item, ok = self.value(item_kind)
            decodes = decodes and ok
            if item_kind == _ARRAY:
                values.extend(item or ())
            else:
                values.append(item)
        return (values if decodes else None), decodes


def read_gguf_file(path: Path) -> GGUFFile:
    """The metadata and tensor index of the GGUF file at `path`.

    Raises:
        ValueError: not a GGUF file of version 2 or 3, truncated, or inconsistent (duplicate
            keys or tensors, a bad alignment, tensor data past the end of the file).
        OSError: the file cannot be read.
    """
    import gguf

    with open(path, "rb") as handle:
        size = Path(path).stat().st_size
        if size == 0:
            raise ValueError("the file is empty")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data)
            if cursor.take("<4s") != b"GGUF":
                raise ValueError("GGUF magic invalid")
            version = cursor.take("<I")
            if version not in _VERSIONS:
                raise ValueError(f"GGUF version {version & 0xFFFFFFFF}, not 2 or 3 (or a big-endian file)")
            tensor_count, field_count = cursor.take("<Q"), cursor.take("<Q")
            metadata = {"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": field_count}
            types = {}
            for _ in range(field_count):
                key = cursor.raw_string().decode("utf-8")
                if key in types or key in metadata:
                    raise ValueError(f"duplicate key {key}")
                types[key] = kind = cursor.take("<I")
                value, decodes = cursor.value(kind)
                if decodes:
                    metadata[key] = value
                else:
                    metadata.pop(key, None)
            index = []
            for _ in range(tensor_count):
                name = cursor.raw_string().decode("utf-8")
                dims = cursor.take(f"<{cursor.take('<I')}Q")
                dims = dims if isinstance(dims, tuple) else (dims,)
                index.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
            header_end = cursor.at
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT) if "general.alignment" in types else _DEFAULT_ALIGNMENT
    if "general.alignment" in types and types["general.alignment"] != _UINT32:
        raise ValueError("bad type for general.alignment")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError("invalid alignment: must be a non-zero power of two")
    data_start = -(-header_end // alignment) * alignment
    tensors, names = [], set()
    for name, dims, raw_type, offset in index:
        if name in names:
            raise ValueError(f"duplicated tensor {name}")
        names.add(name)
        tensor_type = gguf.GGMLQuantizationType(raw_type)
        block_values, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        elements = 1
        for dim in dims:
            elements *= dim
        n_bytes = elements * block_bytes // block_values
        if data_start + offset + n_bytes > size:
            raise ValueError(f"tensor {name}'s data ends past the end of the file")
        tensors.append(GGUFTensor(name, tensor_type, tuple(dims), data_start + offset, n_bytes))
    return GGUFFile(metadata, tensors, alignment)
