"""One GGUF file, opened memory-mapped and checked: metadata and tensor lookup.

GGUF files are untrusted input. Every failure here is a `GGUFError` whose message is one line
naming the file and the key or tensor at fault, so an operator can act on it.

The header is parsed here rather than by gguf-py's `GGUFReader`: that reader builds numpy views
for every element of every metadata array, so a 150k-token vocabulary plus its merges took
10-20 s per open, and every service process opens the model. Reading the same bytes with
`struct` and slicing strings straight out of the mmap gives the same values in well under a
second. gguf-py still supplies the enums and block sizes, so type numbers mean the same thing.

Layout (GGUF v2/v3; every number in the file's byte order):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
    kv_count x (key string | value type u32 | value)
    tensor_count x (name string | n_dims u32 | dims u64[n_dims] | ggml type u32 | offset u64)
    padding to `general.alignment` (default 32) | tensor data, offsets relative to here
A string is a u64 byte length then UTF-8 bytes; an array is item type u32, count u64, items.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

from kernels.quants import QuantTensor, check_supported


class GGUFError(ValueError):
    """A malformed, truncated or unsupported GGUF file."""


_MISSING = object()


class GGUFFile:
    """Metadata as plain python values, tensors as `QuantTensor` views of the mmap."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._data, header = _open(self.path)
        self.metadata: dict[str, Any] = header.metadata
        self._tensors: dict[str, _TensorInfo] = {t.name: t for t in header.tensors}
        self.arch: str = self.require("general.architecture")

    # ---- metadata ------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key, _MISSING)
        if value is _MISSING:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}")
        return value

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, the llama.cpp convention for hyper-parameters."""
        return self.get(f"{self.arch}.{key}", default)

    def arch_require(self, key: str) -> Any:
        return self.require(f"{self.arch}.{key}")

    @property
    def file_id(self) -> str:
        """The identity two services compare before trusting each other's expert ids.

        Name and size, not mtime: a copy of the same file on another host must match.
        """
        return f"{self.path.name}:{self.path.stat().st_size}"

    # ---- tensors -------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> QuantTensor:
        info = self._tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path.name}: missing tensor {name!r}")
        qt = QuantTensor(name, int(info.ggml_type), info.shape, info.view(self._data))
        try:
            check_supported(qt)
        except ValueError as e:
            raise GGUFError(f"{self.path.name}: {e}") from None
        return qt


# ---- opening -----------------------------------------------------------------------------------


class _Unreadable(Exception):
    """The bytes are not a GGUF header we can walk; reported as 'not a readable GGUF file'."""


class _Rejected(Exception):
    """The header parses but names a bad key or tensor; the message is reported as it is."""


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: GGUF lists dims fastest-first, so reversed
    data_offset: int  # absolute, in bytes from the start of the file
    n_bytes: int
    dtype: np.dtype  # how the view reads the bytes: typed for plain types, uint8 rows for blocks
    storage_shape: tuple[int, ...]  # the view's shape: `shape`, but bytes in the last dim for blocks

    def view(self, data: np.ndarray) -> np.ndarray:
        """A read-only view of the mmap; made on demand so opening costs nothing per tensor."""
        raw = data[self.data_offset:self.data_offset + self.n_bytes]
        return raw.view(self.dtype).reshape(self.storage_shape)


@dataclass
class _Header:
    metadata: dict[str, Any]
    tensors: list[_TensorInfo]


def _open(path: Path) -> tuple[np.memmap, _Header]:
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        data = np.memmap(path, mode="r")  # np.memmap: tensor views stay views of the page cache
        return data, _parse(memoryview(data))
    except _Rejected as e:
        raise GGUFError(f"{path.name}: {e}") from None
    except Exception as e:  # _Unreadable, struct.error, bad enum values, bad UTF-8 in names, ...
        raise GGUFError(f"{path.name}: not a readable GGUF file, corrupt or truncated ({_one_line(e)})") from None


def _parse(buf: memoryview) -> _Header:
    r = _Reader(buf)
    if struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise _Unreadable("GGUF magic invalid")
    r.endian = _byte_order(buf)
    r.offset = 8
    tensor_count, kv_count = r.u64(), r.u64()
    metadata, alignment = _read_metadata(r, kv_count)
    tensor_fields = [_read_tensor_field(r) for _ in range(tensor_count)]
    data_start = _align(r.offset, alignment)
    return _Header(metadata, _tensor_infos(tensor_fields, data_start, len(buf), r.endian))


def _byte_order(buf: memoryview) -> str:
    """'<' or '>'. The version is small, so in the wrong byte order its low half reads as zero."""
    version = struct.unpack_from("<I", buf, 4)[0]
    endian = "<"
    if version & 0xFFFF == 0:
        endian, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise _Unreadable(f"GGUF version {version} is not supported (2 and 3 are)")
    return endian


def _align(offset: int, alignment: int) -> int:
    return offset + (-offset % alignment)


# ---- metadata ----------------------------------------------------------------------------------

# struct codes for the fixed-size value types; numpy reads whole arrays of them at once.
_SCALAR_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT32: "f", GGUFValueType.FLOAT64: "d",
    GGUFValueType.BOOL: "?",
}

# gguf-py's reader keeps these three header numbers as pseudo-keys; a file that repeats one
# was rejected as a duplicate key, so it still is. Other "GGUF." keys are left out of metadata.
_HEADER_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})


class _BadValue(Exception):
    """A value whose bytes are there but do not decode (bad UTF-8): the key is to blame."""


class _Reader:
    """A cursor over the header bytes. Every read checks bounds, so truncation fails here."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.offset = 0
        self.endian = "<"

    def take(self, n_bytes: int, what: str) -> int:
        """Advance past `n_bytes`; returns where they start."""
        start = self.offset
        if n_bytes < 0 or start + n_bytes > len(self.buf):
            raise _Unreadable(f"{what} runs past the end of the file at byte {start}")
        self.offset = start + n_bytes
        return start

    def scalar(self, code: str, what: str = "header") -> Any:
        start = self.take(struct.calcsize(code), what)
        return struct.unpack_from(self.endian + code, self.buf, start)[0]

    def u32(self, what: str = "header") -> int:
        return self.scalar("I", what)

    def u64(self, what: str = "header") -> int:
        return self.scalar("Q", what)

    def raw_string(self, what: str) -> memoryview:
        n = self.u64(what)
        start = self.take(n, what)
        return self.buf[start:start + n]


def _read_metadata(r: _Reader, kv_count: int) -> tuple[dict[str, Any], int]:
    """All key/value pairs as python values, and the tensor data alignment they set."""
    metadata: dict[str, Any] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for _ in range(kv_count):
        key = str(r.raw_string("metadata key"), "utf-8")
        value_type = GGUFValueType(r.u32(f"metadata key {key!r}"))
        try:
            value = _read_value(r, value_type, f"metadata key {key!r}")
        except _BadValue as e:
            raise _Rejected(f"metadata key {key!r} is malformed ({e})") from None
        if key in metadata or key in _HEADER_KEYS:
            raise _Unreadable(f"duplicate metadata key {key!r}")
        if key == "general.alignment":
            alignment = _check_alignment(value_type, value)
        if not key.startswith("GGUF."):
            metadata[key] = value
    return metadata, alignment


def _check_alignment(value_type: GGUFValueType, value: Any) -> int:
    if value_type != GGUFValueType.UINT32:
        raise _Unreadable("general.alignment must be a UINT32")
    if value == 0 or value & (value - 1):
        raise _Unreadable(f"general.alignment {value} is not a power of two")
    return value


def _read_value(r: _Reader, value_type: GGUFValueType, what: str) -> Any:
    """One value: python int/float/bool for numbers, str for strings, a flat list for arrays."""
    if value_type == GGUFValueType.STRING:
        return _decode(r.raw_string(what))
    if value_type == GGUFValueType.ARRAY:
        return _read_array(r, what)
    code = _SCALAR_CODES.get(value_type)
    if code is None:
        raise _Unreadable(f"{what}: unhandled value type {value_type!r}")
    return r.scalar(code, what)


def _read_array(r: _Reader, what: str) -> list:
    item_type, count = r.u32(what), r.u64(what)
    if count == 0:
        return []
    item_type = GGUFValueType(item_type)
    if item_type == GGUFValueType.STRING:
        return _read_string_array(r, count, what)
    code = _SCALAR_CODES.get(item_type)
    if code is not None:
        dtype = np.dtype(r.endian + code)
        start = r.take(count * dtype.itemsize, what)
        return np.frombuffer(r.buf, dtype, count, start).tolist()
    # Arrays of arrays come out flattened, as gguf-py's reader gave them.
    return [item for _ in range(count) for item in _read_value(r, item_type, what)]


def _read_string_array(r: _Reader, count: int, what: str) -> list[str]:
    """The hot loop of opening a model: a vocabulary and its merges are ~300k strings.

    Inlined rather than calling `r.raw_string` per item: method calls would triple the cost.
    """
    buf, offset, end = r.buf, r.offset, len(r.buf)
    unpack_length = struct.Struct(r.endian + "Q").unpack_from
    out: list[str] = []
    append = out.append
    try:
        for _ in range(count):
            (n,) = unpack_length(buf, offset)
            offset += 8
            if offset + n > end:
                break
            append(str(buf[offset:offset + n], "utf-8"))
            offset += n
    except struct.error:
        pass  # the length itself was cut off: reported below
    except UnicodeDecodeError as e:
        raise _BadValue(f"item {len(out)}: {_one_line(e)}") from None
    if len(out) != count:
        raise _Unreadable(f"{what} runs past the end of the file at item {len(out)}")
    r.offset = offset
    return out


def _decode(raw: memoryview) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as e:
        raise _BadValue(_one_line(e)) from None


# ---- tensors -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorField:
    name: str
    dims: tuple[int, ...]  # as stored: fastest-varying first
    raw_type: int
    offset: int  # relative to the start of tensor data


def _read_tensor_field(r: _Reader) -> _TensorField:
    name = str(r.raw_string("tensor name"), "utf-8")
    what = f"tensor {name!r}"
    n_dims = r.u32(what)
    start = r.take(8 * n_dims, what)
    dims = struct.unpack_from(f"{r.endian}{n_dims}Q", r.buf, start)
    return _TensorField(name, dims, r.u32(what), r.u64(what))


# Plain element types get typed views; every other type is blocks, viewed as rows of bytes.
_PLAIN_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


def _tensor_infos(fields: list[_TensorField], data_start: int, file_bytes: int, endian: str) -> list[_TensorInfo]:
    infos: list[_TensorInfo] = []
    seen: set[str] = set()
    for f in fields:
        if f.name in seen:
            raise _Unreadable(f"duplicate tensor {f.name!r}")
        seen.add(f.name)
        infos.append(_tensor_info(f, data_start, file_bytes, endian))
    return infos


def _tensor_info(f: _TensorField, data_start: int, file_bytes: int, endian: str) -> _TensorInfo:
    try:
        ggml_type = GGMLQuantizationType(f.raw_type)
    except ValueError:
        raise _Rejected(f"tensor {f.name!r} has unknown GGML type {f.raw_type}") from None
    block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
    n_bytes = math.prod(f.dims) * block_bytes // block_elems
    data_offset = data_start + f.offset
    # A truncated file must fail at open, not when a page fault hits a missing tensor.
    if data_offset + n_bytes > file_bytes:
        raise _Rejected(
            f"tensor {f.name!r} runs past the end of the file "
            f"(needs {data_offset + n_bytes} bytes, file has {file_bytes}): truncated?")
    shape = tuple(reversed(f.dims))
    plain = _PLAIN_DTYPES.get(ggml_type)
    if plain is not None:
        dtype, storage_shape = np.dtype(plain).newbyteorder(endian), shape
    else:
        dtype, storage_shape = np.dtype(np.uint8), _block_storage_shape(f.name, shape, ggml_type)
    return _TensorInfo(f.name, ggml_type, shape, data_offset, n_bytes, dtype, storage_shape)


def _block_storage_shape(name: str, shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> tuple[int, ...]:
    if not shape:
        raise _Unreadable(f"tensor {name!r}: a {ggml_type.name} tensor needs at least one dim")
    try:
        return quant_shape_to_byte_shape(shape, ggml_type)
    except ValueError as e:
        raise _Unreadable(f"tensor {name!r}: {e}") from None


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
