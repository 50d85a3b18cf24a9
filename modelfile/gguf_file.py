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

What opening checks, before anything is allocated from a number the file gives: counts and
lengths fit in the bytes the file has; every tensor has a known type, 1 to 4 dims of at least one
element, rows that are whole quant blocks, and is aligned and inside the file; and the data section
holds nothing but the tensors, each padded to the alignment, none overlapping another, as every
writer (gguf-py, ggml) lays it out. A tensor count or an offset that is off then cannot pass as
another tensor's bytes; GGUF has no checksum, so bytes inside a tensor are taken as they are.

A model split by llama-gguf-split is opened from its first part (`gguf_parts` finds and checks the
rest): metadata comes from the first part, tensors from whichever part holds them, each a view of
that part's own mmap.
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

from splitmoe.kernels.quants import QuantTensor, check_supported


class GGUFError(ValueError):
    """A malformed, truncated or unsupported GGUF file."""


_MISSING = object()

_INT_TYPES = frozenset({GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
                        GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64})
# What a typed read accepts for each python type: any integer width (values are range-checked by
# whoever reads them), but never a float or bool standing in for an integer or the reverse, since
# the same bytes read as another type are another number (llama.cpp refuses them too).
_VALUE_KINDS: dict[type, tuple[frozenset, str]] = {
    int: (_INT_TYPES, "an integer"),
    float: (frozenset({GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}), "a float"),
    bool: (frozenset({GGUFValueType.BOOL}), "a bool"),
    str: (frozenset({GGUFValueType.STRING}), "a string"),
    list: (frozenset({GGUFValueType.ARRAY}), "an array"),
}


class GGUFFile:
    """Metadata as plain python values, tensors as `QuantTensor` views of the mmap."""

    def __init__(self, path: str | os.PathLike):
        """`path`: a GGUF file, or the first part of a split one (every part is opened)."""
        from splitmoe.modelfile.gguf_parts import open_later_parts  # here: that module builds on this one

        self.path = Path(path)
        first = open_part(self.path)
        parts = [first, *open_later_parts(first)]
        self.parts: list[Path] = [part.path for part in parts]  # the first is `path`
        self.metadata: dict[str, Any] = first.header.metadata
        self._value_types: dict[str, GGUFValueType] = first.header.value_types
        self._tensors: dict[str, tuple[_TensorInfo, GGUFPart]] = {
            t.name: (t, part) for part in parts for t in part.header.tensors}
        self.arch: str = self.value("general.architecture", str)

    # ---- metadata ------------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        value = self.metadata.get(key, _MISSING)
        if value is _MISSING:
            raise GGUFError(f"{self.path.name}: missing metadata key {key!r}")
        return value

    def value(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """`key`'s value, which the file must store as `kind` (int, float, bool, str or list); `default`
        where the key is absent, and without one a missing key is an error."""
        value_type = self._value_types.get(key)
        if value_type is None:
            return self.require(key) if default is _MISSING else default
        accepted, kind_name = _VALUE_KINDS[kind]
        if value_type not in accepted:
            raise GGUFError(f"{self.path.name}: metadata key {key!r} is {value_type.name}, expected {kind_name}")
        return self.metadata[key]

    def arch_value(self, key: str, kind: type, default: Any = _MISSING) -> Any:
        """`arch_get` as `value` reads."""
        return self.value(f"{self.arch}.{key}", kind, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, the llama.cpp convention for hyper-parameters."""
        return self.get(f"{self.arch}.{key}", default)

    def arch_require(self, key: str) -> Any:
        return self.require(f"{self.arch}.{key}")

    @property
    def file_id(self) -> str:
        """The identity two services compare before trusting each other's expert ids.

        Name and size, not mtime: a copy of the same file on another host must match. A split
        model's id has every part's size: the first part's name already says how many there are.
        """
        return f"{self.path.name}:{'+'.join(str(p.stat().st_size) for p in self.parts)}"

    # ---- tensors -------------------------------------------------------------------------------

    @property
    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> QuantTensor:
        """`shape`: the torch-order shape the hyper-parameters give it, checked here.

        Shapes compare as ggml compares them: size-1 dims the file lists last (first in torch
        order) do not count, since llama-quantize drops them; the tensor comes back in `shape`.
        """
        found = self._tensors.get(name)
        if found is None:
            raise GGUFError(f"{self.path.name}: missing tensor {name!r}")
        info, part = found
        data = info.view(part.data)
        if shape is not None and tuple(shape) != info.shape:
            if _without_leading_ones(shape) != _without_leading_ones(info.shape):
                raise GGUFError(f"{part.path.name}: tensor {name!r} has shape {list(info.shape)}, but the "
                                f"hyper-parameters give {list(shape)}")
            data = data.reshape(tuple(shape[:-1]) + data.shape[-1:])  # the row (of values or bytes) is kept
        qt = QuantTensor(name, int(info.ggml_type), tuple(shape) if shape is not None else info.shape, data)
        try:
            check_supported(qt)
        except ValueError as e:
            raise GGUFError(f"{part.path.name}: {e}") from None
        return qt


def _without_leading_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    i = 0
    while i < len(shape) - 1 and shape[i] == 1:
        i += 1
    return tuple(shape[i:])


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
    value_types: dict[str, GGUFValueType]
    tensors: list[_TensorInfo]


@dataclass(frozen=True)
class GGUFPart:
    """One file of a model, parsed and mapped: the whole model, or one part of a split one."""
    path: Path
    data: np.memmap
    header: _Header


def open_part(path: Path) -> GGUFPart:
    """One file, parsed and checked on its own (a split model's parts are checked together by
    `gguf_parts`)."""
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    try:
        if path.stat().st_size < _HEADER_BYTES:  # also what np.memmap cannot map: an empty file
            raise _Unreadable(f"the file is {path.stat().st_size} bytes, shorter than a GGUF header")
        data = np.memmap(path, mode="r")  # np.memmap: tensor views stay views of the page cache
        return GGUFPart(path, data, _parse(memoryview(data)))
    except _Rejected as e:
        raise GGUFError(f"{path.name}: {e}") from None
    except Exception as e:  # _Unreadable, or the mmap itself failing (an empty file)
        why = str(e) if isinstance(e, _Unreadable) else _one_line(e)
        raise GGUFError(f"{path.name}: not a readable GGUF file, corrupt or truncated ({why})") from None


def _parse(buf: memoryview) -> _Header:
    r = _Reader(buf)
    if struct.unpack_from("<I", buf, 0)[0] != GGUF_MAGIC:
        raise _Unreadable("GGUF magic invalid")
    r.endian = _byte_order(buf)
    r.offset = 8
    tensor_count, kv_count = r.u64("tensor_count"), r.u64("kv_count")
    r.fits(kv_count, _MIN_KV_BYTES, "kv_count")
    metadata, value_types, alignment = _read_metadata(r, kv_count)
    r.fits(tensor_count, _MIN_TENSOR_INFO_BYTES, "tensor_count")
    tensor_fields = [_read_tensor_field(r, i) for i in range(tensor_count)]
    data_start = _align(r.offset, alignment)
    tensors = _tensor_infos(tensor_fields, data_start, r.endian)
    _check_data_layout(tensors, data_start, len(buf), alignment)
    return _Header(metadata, value_types, tensors)


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


_HEADER_BYTES = 4 + 4 + 8 + 8  # magic, version, tensor_count, kv_count
# The fewest bytes one entry can take, to bound a count by the bytes left before reading on:
# a key/value is a key length, a value type and at least one byte of value; a tensor info is a
# name length, n_dims, one dim, a type and an offset.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


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
# The fewest bytes an array item of a non-scalar type takes: a string's length, a nested array's
# item type and count.
_MIN_ITEM_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8}
# Arrays of arrays are legal; deeper than this is no metadata anyone writes, only a way to recurse.
_MAX_ARRAY_DEPTH = 4

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

    def fits(self, count: int, min_bytes: int, what: str) -> None:
        """`count` entries of at least `min_bytes` each must fit in the bytes left: checked before
        a loop over them, so a count in the billions fails at once instead of exhausting memory."""
        left = len(self.buf) - self.offset
        if count * min_bytes > left:
            raise _Rejected(f"{what} {count} needs at least {count * min_bytes} bytes, the file has {left} left: "
                            "truncated or corrupt")

    def scalar(self, code: str, what: str) -> Any:
        start = self.take(struct.calcsize(code), what)
        return struct.unpack_from(self.endian + code, self.buf, start)[0]

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def raw_string(self, what: str) -> memoryview:
        n = self.u64(what)
        start = self.take(n, what)
        return self.buf[start:start + n]

    def name(self, what: str) -> str:
        """A key or tensor name: non-empty UTF-8, or errors could not name what they are about."""
        try:
            name = str(self.raw_string(what), "utf-8")
        except UnicodeDecodeError:
            raise _Rejected(f"{what} is not UTF-8") from None
        if not name:
            raise _Rejected(f"{what} is empty")
        return name


def _read_metadata(r: _Reader, kv_count: int) -> tuple[dict[str, Any], dict[str, GGUFValueType], int]:
    """All key/value pairs as python values, their GGUF types, and the tensor data alignment."""
    metadata: dict[str, Any] = {}
    value_types: dict[str, GGUFValueType] = {}
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(kv_count):
        key = r.name(f"metadata key #{i}")
        what = f"metadata key {key!r}"
        value_type = _value_type(r.u32(what), what)
        try:
            value = _read_value(r, value_type, what, depth=0)
        except _BadValue as e:
            raise _Rejected(f"{what} is malformed ({e})") from None
        if key in metadata or key in _HEADER_KEYS:
            raise _Rejected(f"duplicate metadata key {key!r}")
        if key == "general.alignment":
            alignment = _check_alignment(value_type, value)
        if not key.startswith("GGUF."):
            metadata[key] = value
            value_types[key] = value_type
    return metadata, value_types, alignment


def _value_type(raw: int, what: str) -> GGUFValueType:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise _Rejected(f"{what} has unknown value type {raw}") from None


def _check_alignment(value_type: GGUFValueType, value: Any) -> int:
    if value_type != GGUFValueType.UINT32:
        raise _Rejected(f"metadata key 'general.alignment' is {value_type.name}, expected UINT32")
    if value == 0 or value & (value - 1):
        raise _Rejected(f"metadata key 'general.alignment' = {value} is not a power of two")
    return value


def _read_value(r: _Reader, value_type: GGUFValueType, what: str, depth: int) -> Any:
    """One value: python int/float/bool for numbers, str for strings, a flat list for arrays."""
    if value_type == GGUFValueType.STRING:
        return _decode(r.raw_string(what))
    if value_type == GGUFValueType.ARRAY:
        if depth == _MAX_ARRAY_DEPTH:
            raise _Rejected(f"{what} nests arrays more than {_MAX_ARRAY_DEPTH} deep")
        return _read_array(r, what, depth + 1)
    return r.scalar(_SCALAR_CODES[value_type], what)


def _read_array(r: _Reader, what: str, depth: int) -> list:
    item_type, count = _value_type(r.u32(what), f"{what}'s items"), r.u64(what)
    code = _SCALAR_CODES.get(item_type)
    r.fits(count, np.dtype(code).itemsize if code else _MIN_ITEM_BYTES[item_type], f"{what}: item count")
    if count == 0:
        return []
    if item_type == GGUFValueType.STRING:
        return _read_string_array(r, count, what)
    if code is not None:
        dtype = np.dtype(r.endian + code)
        start = r.take(count * dtype.itemsize, what)
        return np.frombuffer(r.buf, dtype, count, start).tolist()
    # Arrays of arrays come out flattened, as gguf-py's reader gave them.
    return [item for _ in range(count) for item in _read_value(r, item_type, what, depth)]


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

# ggml's GGML_MAX_DIMS; and its element counts are int64.
_MAX_DIMS = 4
_MAX_ELEMENTS = 2**63 - 1


@dataclass(frozen=True)
class _TensorField:
    name: str
    dims: tuple[int, ...]  # as stored: fastest-varying first
    raw_type: int
    offset: int  # relative to the start of tensor data


def _read_tensor_field(r: _Reader, index: int) -> _TensorField:
    name = r.name(f"tensor #{index}'s name")
    what = f"tensor {name!r}"
    n_dims = r.u32(what)
    if not 1 <= n_dims <= _MAX_DIMS:
        raise _Rejected(f"{what} has {n_dims} dims (GGUF allows 1 to {_MAX_DIMS})")
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


def _tensor_infos(fields: list[_TensorField], data_start: int, endian: str) -> list[_TensorInfo]:
    infos: list[_TensorInfo] = []
    seen: set[str] = set()
    for f in fields:
        if f.name in seen:
            raise _Rejected(f"duplicate tensor {f.name!r}")
        seen.add(f.name)
        infos.append(_tensor_info(f, data_start, endian))
    return infos


def _tensor_info(f: _TensorField, data_start: int, endian: str) -> _TensorInfo:
    what = f"tensor {f.name!r}"
    try:
        ggml_type = GGMLQuantizationType(f.raw_type)
    except ValueError:
        raise _Rejected(f"{what} has unknown GGML type {f.raw_type}") from None
    shape = tuple(reversed(f.dims))
    if min(f.dims) < 1 or math.prod(f.dims) > _MAX_ELEMENTS:
        raise _Rejected(f"{what} has shape {list(shape)}: every dim must be at least 1, "
                        f"and at most 2^63-1 elements in all")
    block_elems, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if f.dims[0] % block_elems:
        raise _Rejected(f"{what} has rows of {f.dims[0]} values, not a whole number of "
                        f"{ggml_type.name} blocks ({block_elems} values each)")
    n_bytes = math.prod(f.dims) // block_elems * block_bytes
    plain = _PLAIN_DTYPES.get(ggml_type)
    if plain is not None:
        dtype, storage_shape = np.dtype(plain).newbyteorder(endian), shape
    else:
        dtype, storage_shape = np.dtype(np.uint8), quant_shape_to_byte_shape(shape, ggml_type)
    return _TensorInfo(f.name, ggml_type, shape, data_start + f.offset, n_bytes, dtype, storage_shape)


def _check_data_layout(tensors: list[_TensorInfo], data_start: int, file_bytes: int, alignment: int) -> None:
    """Every tensor aligned and inside the file; together, the whole data section and no more."""
    for t in tensors:
        offset = t.data_offset - data_start
        if offset % alignment:
            raise _Rejected(f"tensor {t.name!r} at data offset {offset} is not aligned to {alignment} bytes")
        # A truncated file must fail at open, not when a page fault hits a missing tensor.
        if t.data_offset + t.n_bytes > file_bytes:
            raise _Rejected(f"tensor {t.name!r} runs past the end of the file "
                            f"(needs {t.data_offset + t.n_bytes} bytes, file has {file_bytes}): truncated?")
    end, previous = data_start, None
    for t in sorted(tensors, key=lambda t: t.data_offset):
        if previous is not None and t.data_offset < previous.data_offset + previous.n_bytes:
            raise _Rejected(f"tensor {t.name!r} overlaps tensor {previous.name!r}")
        if t.data_offset > end:
            after = f"after tensor {previous.name!r}" if previous else "at the start of the data section"
            raise _Rejected(f"{t.data_offset - end} bytes {after} belong to no tensor "
                            f"(before tensor {t.name!r}): a tensor missing, or its offset wrong?")
        end, previous = _align(t.data_offset + t.n_bytes, alignment), t
    if file_bytes > end:
        after = f"after the last tensor, {previous.name!r}," if previous else "after the header"
        raise _Rejected(f"{file_bytes - end} bytes {after} belong to no tensor: tensor_count wrong?")


def _one_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
