"""A GGUF's header alone: its metadata keys and its tensors' names, shapes, types and offsets, parsed
straight from the file.

gguf-py's GGUFReader builds a numpy view for every part of every key, so a vocabulary costs memory and time
by the token: measured per reader, 160 MiB and 2-3 s for SmolLM2-135M's (49,152 tokens), 490 MiB and 8-10 s
for Qwen2.5's (151,936), against 10 and 30 MiB, 0.1-0.5 s here (docs/results/rss-accounting.md, section 3). What
reads a few numbers (gguf.metadata: KV sizes, layer types, windows, training context; model_source's checks)
takes this reader; what reads tensor data or copies keys to a writer takes gguf-py's.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # GGUF's, where general.alignment is absent

# GGUF value types (gguf.GGUFValueType): struct format of the fixed-size ones
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class NotGguf(ValueError):
    """The file does not start with the GGUF magic."""


class HeaderTruncated(ValueError):
    """The file ends before the header, or the tensor data it declares, does."""


@dataclass(frozen=True)
class HeaderField:
    """One metadata key: ``contents()`` gives what gguf-py's ReaderField.contents() gives (a str, a number, a
    bool, or a list of them for an array)."""

    name: str
    types: tuple[int, ...]  # the value type, then an array's element type(s), as gguf-py's ReaderField.types
    value: object

    def contents(self):
        value = self.value
        return value.tolist() if isinstance(value, np.ndarray) else value


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor's entry: gguf-py's ReaderTensor without the data (``shape`` in GGUF's order, innermost first)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: object  # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    endianess: str  # "<" or ">"
    alignment: int
    fields: dict[str, HeaderField]
    tensors: list[HeaderTensor]


class _Cursor:
    """Reads the header from a buffered file: no view of the file outlives the parse."""

    def __init__(self, handle, order: str, file_size: int):
        self.handle, self.order, self.at, self.file_size = handle, order, handle.tell(), file_size

    def take(self, size: int) -> bytes:
        # a damaged length must not become a read of that many bytes: the file's size bounds it first
        fits = 0 <= size <= self.file_size - self.at
        piece = self.handle.read(size) if fits else b""
        if not fits or len(piece) < size:
            raise HeaderTruncated(f"the header runs past the end of the file at byte {self.at:,}")
        self.at += size
        return piece

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        return struct.unpack(self.order + fmt, self.take(size))[0]

    def string(self) -> str:
        return self.take(self.unpack("Q")).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> tuple[tuple[int, ...], object]:
        """(types, value) of one value of ``value_type``."""
        if value_type in _SCALARS:
            return (value_type,), self.unpack(_SCALARS[value_type])
        if value_type == _STRING:
            return (value_type,), self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.at:,}")
        element, count = self.unpack("I"), self.unpack("Q")
        if element in _SCALARS:
            fmt = _SCALARS[element]
            dtype = np.dtype(fmt if fmt != "?" else "u1").newbyteorder(self.order)
            values = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return (value_type, element), values.astype(bool) if fmt == "?" else values
        if element == _STRING:
            return (value_type, element), [self.string() for _ in range(count)]
        items = [self.value(element) for _ in range(count)]  # arrays of arrays
        inner = items[0][0] if items else (element,)
        return (value_type, *inner), [v.tolist() if isinstance(v, np.ndarray) else v for _, v in items]


def read_header(path: str | os.PathLike) -> GgufHeader:
    """The header of the GGUF ``path``; ValueError for a file that is not one (NotGguf without the magic,
    HeaderTruncated where the file is cut short). The caller checks that the file exists
    (nbl_gguf.gguf.metadata.open_gguf)."""
    import gguf

    path = Path(path)
    size = path.stat().st_size
    with path.open("rb", buffering=1 << 20) as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise NotGguf("it does not start with the GGUF magic")
        raw_version = handle.read(4)
        if len(raw_version) < 4:
            raise HeaderTruncated(f"{size} bytes: shorter than a GGUF header")
        order = "<" if struct.unpack("<I", raw_version)[0] & 0xFFFF else ">"  # byte-swapped: a big-endian file
        version = struct.unpack(order + "I", raw_version)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (this reader knows 2 and 3)")
        cursor = _Cursor(handle, order, size)
        n_tensors, n_kv = cursor.unpack("Q"), cursor.unpack("Q")
        # gguf-py's reader shows the header's own numbers as fields too
        fields = {"GGUF.version": HeaderField("GGUF.version", (4,), version),
                  "GGUF.tensor_count": HeaderField("GGUF.tensor_count", (10,), n_tensors),
                  "GGUF.kv_count": HeaderField("GGUF.kv_count", (10,), n_kv)}
        for _ in range(n_kv):
            name = cursor.string()
            types, value = cursor.value(cursor.unpack("I"))
            fields[name] = HeaderField(name, types, value)
        entries = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = tuple(cursor.unpack("Q") for _ in range(cursor.unpack("I")))
            entries.append((name, dims, cursor.unpack("I"), cursor.unpack("Q")))
        header_end = cursor.at
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else DEFAULT_ALIGNMENT
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two (llama.cpp refuses it)")
    data_start = -(-header_end // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in entries:
        tensor_type = gguf.GGMLQuantizationType(type_id)
        block, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        n_bytes = n_elements // block * type_size
        if data_start + offset + n_bytes > size:
            raise HeaderTruncated(f"tensor {name} ends at byte {data_start + offset + n_bytes:,}, past the end of "
                                  f"the file ({size:,} bytes)")
        tensors.append(HeaderTensor(name, dims, tensor_type, n_elements, n_bytes, data_start + offset))
    return GgufHeader(path, version, order, alignment, fields, tensors)
