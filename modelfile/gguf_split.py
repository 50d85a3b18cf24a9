"""Writing a GGUF file as a split set of parts, in llama-gguf-split's format.

Part i of n is `<prefix>-<i:05d>-of-<n:05d>.gguf`, a whole GGUF v3 file: the first holds every
metadata key of the source plus `split.no` (u16, 0-based), `split.count` (u16) and
`split.tensors.count` (i32, all parts' tensors); later parts hold the three split keys only, so
they take the default alignment. Each part lists its own tensors, with offsets into its own data
section, each tensor padded to the part's alignment. Tensors go to parts in the source's order.

Metadata values are copied byte for byte, as gguf-py's reader delimits them, so nothing is
re-encoded; tensor bytes are copied as they are. Only little-endian sources are split (the GGUF
files published are).
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
from gguf import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFEndian, GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderTensor

from splitmoe.modelfile.gguf_parts import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, part_name

_VERSION = 3


def split_gguf(path: str | os.PathLike, out_prefix: str | os.PathLike, parts: int, *,
               metadata_only_first: bool = False) -> list[Path]:
    """Write `path` as `parts` files named from `out_prefix`; returns their paths, first first.

    `metadata_only_first`: the first part holds no tensors, as `llama-gguf-split --no-tensor-first-split`.
    """
    reader = GGUFReader(path, "r")
    if reader.endianess != GGUFEndian.LITTLE:
        raise ValueError(f"{Path(path).name}: big-endian GGUF files are not split here")
    if any(name.startswith("split.") for name in reader.fields):
        raise ValueError(f"{Path(path).name}: already a part of a split model")
    metadata = [_field_bytes(f.parts) for name, f in reader.fields.items() if not name.startswith("GGUF.")]
    groups = _share(reader.tensors, parts, metadata_only_first)
    out_prefix = Path(out_prefix)
    paths = []
    for index, tensors in enumerate(groups):
        kvs = (metadata if index == 0 else []) + _split_keys(index, parts, len(reader.tensors))
        alignment = reader.alignment if index == 0 else GGUF_DEFAULT_ALIGNMENT
        out = out_prefix.with_name(part_name(out_prefix.name, index, parts))
        with open(out, "wb") as f:
            _write_part(f, kvs, tensors, reader.data, alignment)
        paths.append(out)
    return paths


def _share(tensors: list[ReaderTensor], parts: int, metadata_only_first: bool) -> list[list[ReaderTensor]]:
    """Tensors in order, as evenly as counts go, over the parts that hold tensors."""
    holders = parts - 1 if metadata_only_first else parts
    if holders < 1 or holders > len(tensors):
        raise ValueError(f"cannot share {len(tensors)} tensors over {holders} parts")
    bounds = [round(i * len(tensors) / holders) for i in range(holders + 1)]
    return ([[]] if metadata_only_first else []) + [tensors[a:b] for a, b in zip(bounds, bounds[1:])]


def _field_bytes(parts: list[np.ndarray]) -> bytes:
    return b"".join(p.tobytes() for p in parts)


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _split_keys(index: int, count: int, total: int) -> list[bytes]:
    return [_string(SPLIT_NO) + struct.pack("<IH", GGUFValueType.UINT16, index),
            _string(SPLIT_COUNT) + struct.pack("<IH", GGUFValueType.UINT16, count),
            _string(SPLIT_TENSORS_COUNT) + struct.pack("<Ii", GGUFValueType.INT32, total)]


def _write_part(f: BinaryIO, kvs: list[bytes], tensors: list[ReaderTensor], source: np.ndarray,
                alignment: int) -> None:
    f.write(struct.pack("<IIQQ", GGUF_MAGIC, _VERSION, len(tensors), len(kvs)))
    f.write(b"".join(kvs))
    offset = 0
    for t in tensors:
        dims = [int(d) for d in t.shape]  # as the file stores them: fastest-varying first
        f.write(_string(t.name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, int(t.tensor_type), offset))
        offset += _padded(int(t.n_bytes), alignment)
    _pad(f, alignment)
    for t in tensors:
        start = int(t.data_offset)
        f.write(source[start:start + int(t.n_bytes)].tobytes())
        _pad(f, alignment)


def _padded(n: int, alignment: int) -> int:
    return n + (-n % alignment)


def _pad(f: BinaryIO, alignment: int) -> None:
    f.write(b"\0" * (-f.tell() % alignment))
