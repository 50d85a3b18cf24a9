"""Where each field of a GGUF file lies, byte by byte: what targeted mutation tests aim at.

Read with gguf-py's GGUFReader, an implementation independent of modelfile/gguf_file.py, so a
test's idea of the layout does not come from the code it tests.
"""
from __future__ import annotations

from dataclasses import dataclass
from os import PathLike

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType


@dataclass(frozen=True)
class Span:
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class KeyValue:
    key: str
    value_type: GGUFValueType
    key_length: Span  # u64
    key_name: Span  # the key's UTF-8 bytes
    type_id: Span  # u32
    value: Span  # every byte of the value, lengths and counts included
    string_length: Span | None = None  # a string value's u64 length
    item_type: Span | None = None  # an array's u32 item type
    count: Span | None = None  # an array's u64 item count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    dims: tuple[int, ...]  # as stored: fastest-varying first
    name_length: Span  # u64
    name_bytes: Span
    n_dims: Span  # u32
    dim_fields: tuple[Span, ...]  # one u64 each
    type_id: Span  # u32
    offset: Span  # u64, relative to the data section
    data: Span  # the tensor's bytes, absolute


@dataclass(frozen=True)
class Layout:
    size: int
    alignment: int
    version: Span
    tensor_count: Span
    kv_count: Span
    kvs: dict[str, KeyValue]
    tensors: dict[str, TensorInfo]
    data_start: int

    @property
    def metadata(self) -> Span:
        first = min(kv.key_length.start for kv in self.kvs.values())
        return Span(first, max(kv.value.end for kv in self.kvs.values()) - first)

    @property
    def tensor_infos(self) -> Span:
        first = min(t.name_length.start for t in self.tensors.values())
        last = max(t.offset.end for t in self.tensors.values())
        return Span(first, last - first)


def read_layout(path: str | PathLike) -> Layout:
    reader = GGUFReader(path)
    header = {k: _part_spans(f)[0] for k, f in reader.fields.items() if k.startswith("GGUF.")}
    kvs = {k: _key_value(k, f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: _tensor_info(t, reader.data_offset) for t in reader.tensors}
    return Layout(size=len(reader.data), alignment=reader.alignment, version=header["GGUF.version"],
                  tensor_count=header["GGUF.tensor_count"], kv_count=header["GGUF.kv_count"], kvs=kvs,
                  tensors=tensors, data_start=reader.data_offset)


def _part_spans(field) -> list[Span]:
    spans, at = [], field.offset
    for part in field.parts:
        spans.append(Span(at, part.nbytes))
        at += part.nbytes
    return spans


def _key_value(key: str, field) -> KeyValue:
    spans = _part_spans(field)
    value_type = GGUFValueType(field.types[0])
    value = Span(spans[3].start, spans[-1].end - spans[3].start)
    kv = KeyValue(key, value_type, spans[0], spans[1], spans[2], value)
    if value_type == GGUFValueType.STRING:
        return KeyValue(**{**kv.__dict__, "string_length": spans[3]})
    if value_type == GGUFValueType.ARRAY:
        return KeyValue(**{**kv.__dict__, "item_type": spans[3], "count": spans[4]})
    return kv


def _tensor_info(tensor, data_start: int) -> TensorInfo:
    name_length, name_bytes, n_dims, dims, type_id, offset = _part_spans(tensor.field)
    n = dims.size // 8
    return TensorInfo(
        name=tensor.name, ggml_type=GGMLQuantizationType(tensor.tensor_type),
        dims=tuple(int(d) for d in tensor.field.parts[3]), name_length=name_length, name_bytes=name_bytes,
        n_dims=n_dims, dim_fields=tuple(Span(dims.start + 8 * i, 8) for i in range(n)), type_id=type_id,
        offset=offset, data=Span(tensor.data_offset, int(tensor.n_bytes)))
