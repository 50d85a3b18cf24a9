"""GGUFFile's own header parser against gguf-py's GGUFReader, and its errors on broken bytes.

GGUFFile used to wrap GGUFReader; it now parses the header itself because GGUFReader takes
10-20 s on a real vocabulary. These tests pin that every value, type and tensor view is the
same as GGUFReader gives, and that bad files still fail with one line naming the file.
"""
from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter

from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from tests.support.gguf_layout import read_layout

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
FIXTURE_FILES = sorted(FIXTURES.glob("*/*.gguf")) if FIXTURES.is_dir() else []


# ---- reference: what GGUFReader makes of the same file -----------------------------------------


def same_value(a, b) -> bool:
    """Equal and of the same python type, all the way down (1 == 1.0 == True must not pass)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def assert_matches_gguf_py(path: Path) -> None:
    ours, ref = GGUFFile(path), GGUFReader(path, "r")
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(expected)
    for key, value in expected.items():
        assert same_value(ours.metadata[key], value), key
    assert ours.tensor_names == [t.name for t in ref.tensors]
    for t in ref.tensors:
        qt = ours.tensor(t.name)
        assert qt.ggml_type == int(t.tensor_type)
        assert qt.shape == tuple(int(d) for d in reversed(t.shape))
        assert qt.data.dtype == t.data.dtype and qt.data.shape == t.data.shape
        assert isinstance(qt.data, np.memmap) and not qt.data.flags.writeable
        assert np.array_equal(qt.data, t.data, equal_nan=True), t.name


@pytest.mark.skipif(not FIXTURE_FILES, reason=f"../shared/fixtures not found: {FIXTURES}")
@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixtures_read_as_gguf_py_reads_them(path):
    assert_matches_gguf_py(path)


def test_demo_model_reads_as_gguf_py_reads_it(demo_gguf):
    assert_matches_gguf_py(demo_gguf)


# ---- small hand-made files ---------------------------------------------------------------------


def write_gguf(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE, alignment: int | None = None) -> Path:
    """Every value type, a vocabulary-like string array, plain and block tensors."""
    w = GGUFWriter(str(path), "qwen3moe", endianess=endian)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_string("test.name", "AAAA-name")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -5)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 0.1)  # not exact in float32: must come back as float32(0.1), widened
    w.add_float64("test.f64", 0.1)
    w.add_bool("test.bool", True)
    w.add_array("test.tokens", ["<s>", "héllo", "", "Ġworld", "日本"] + [f"tok{i}" for i in range(2000)])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 0.1, -2.0])
    w.add_array("test.bools", [True, False])
    w.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("f16", np.arange(8, dtype=np.float16).reshape(2, 4))
    w.add_tensor("q8", np.arange(2 * 34, dtype=np.uint8).reshape(2, 34), raw_dtype=GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_values_have_the_types_gguf_py_gives(tmp_path):
    g = GGUFFile(write_gguf(tmp_path / "t.gguf"))
    m = g.metadata
    assert m["test.name"] == "AAAA-name"
    assert (m["test.u8"], m["test.i8"], m["test.u16"], m["test.i16"]) == (200, -5, 60000, -30000)
    assert (m["test.u32"], m["test.i32"], m["test.u64"], m["test.i64"]) == (4_000_000_000, -2_000_000_000,
                                                                            2**63 + 5, -(2**62))
    assert m["test.f32"] == float(np.float32(0.1)) and type(m["test.f32"]) is float
    assert m["test.f64"] == 0.1 and m["test.bool"] is True
    assert m["test.tokens"][:5] == ["<s>", "héllo", "", "Ġworld", "日本"] and len(m["test.tokens"]) == 2005
    assert m["test.ints"] == [1, -2, 3] and all(type(v) is int for v in m["test.ints"])
    assert m["test.floats"] == [0.5, float(np.float32(0.1)), -2.0]
    assert m["test.bools"] == [True, False]
    assert np.array_equal(g.tensor("f32").data, np.arange(12, dtype=np.float32).reshape(3, 4))
    assert g.tensor("q8").shape == (2, 32) and g.tensor("q8").data.shape == (2, 34)
    assert_matches_gguf_py(tmp_path / "t.gguf")


def test_big_endian_file(tmp_path):
    assert_matches_gguf_py(write_gguf(tmp_path / "be.gguf", endian=GGUFEndian.BIG))


def test_custom_alignment(tmp_path):
    assert_matches_gguf_py(write_gguf(tmp_path / "a.gguf", alignment=64))


# ---- broken bytes ------------------------------------------------------------------------------


def open_error(path: Path) -> str:
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    line = str(e.value)
    assert "\n" not in line and path.name in line
    return line


def patched(src: Path, dst: Path, find: bytes, replace: bytes, after: int = 0) -> Path:
    """`src` with the bytes `after` bytes past the first `find` overwritten by `replace`."""
    data = bytearray(src.read_bytes())
    at = data.index(find) + after
    data[at:at + len(replace)] = replace
    dst.write_bytes(bytes(data))
    return dst


def test_empty_file(tmp_path):
    (tmp_path / "e.gguf").write_bytes(b"")
    assert "not a readable GGUF file" in open_error(tmp_path / "e.gguf")


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        GGUFFile(tmp_path / "nope.gguf")


def test_unsupported_version(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    line = open_error(patched(good, tmp_path / "v.gguf", b"GGUF", struct.pack("<I", 1), after=4))
    assert "not a readable GGUF file" in line and "version 1" in line


def test_truncated_inside_a_string_array(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    data = good.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:data.index(b"tok1000")])
    line = open_error(cut)
    assert "'test.tokens'" in line and "truncated" in line


def test_truncated_tensor_data(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-40])  # the last tensor is 68 bytes, then padding
    line = open_error(cut)
    assert "'q8'" in line and "truncated" in line


def test_bad_utf8_value_names_the_key(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    line = open_error(patched(good, tmp_path / "u.gguf", b"AAAA-name", b"\xff\xfe"))
    assert "metadata key 'test.name' is malformed" in line and "UnicodeDecodeError" in line


def test_bad_utf8_in_string_array_names_the_key(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    line = open_error(patched(good, tmp_path / "u.gguf", b"tok1500", b"\xff"))
    assert "metadata key 'test.tokens' is malformed" in line and "item 1505" in line


def test_bad_alignment(tmp_path):
    good = write_gguf(tmp_path / "t.gguf", alignment=64)
    # key string, then u32 value type, then the u32 value
    line = open_error(patched(good, tmp_path / "a.gguf", b"general.alignment", struct.pack("<I", 48), after=21))
    assert "metadata key 'general.alignment' = 48 is not a power of two" in line


def test_unknown_tensor_type_names_the_tensor(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    # tensor info: name "f16", u32 n_dims (2), two u64 dims, then the u32 type
    line = open_error(patched(good, tmp_path / "t2.gguf", b"\x03\x00\x00\x00\x00\x00\x00\x00f16",
                              struct.pack("<I", 200), after=11 + 4 + 16))
    assert "tensor 'f16' has unknown GGML type 200" in line


def test_duplicate_key(tmp_path):
    good = write_gguf(tmp_path / "t.gguf")
    line = open_error(patched(good, tmp_path / "d.gguf", b"test.i8", b"test.u8"))
    assert "duplicate metadata key 'test.u8'" in line


# ---- the tensor data layout, counts and lengths (byte patches aimed by tests/support/gguf_layout.py)


def demo_patched(demo_gguf: Path, dst: Path, span, value, code: str) -> Path:
    data = bytearray(demo_gguf.read_bytes())
    struct.pack_into("<" + code, data, span.start, value)
    dst.write_bytes(bytes(data))
    return dst


@pytest.fixture(scope="module")
def demo_layout(demo_gguf):
    return read_layout(demo_gguf)


def own_offset(layout, t) -> int:
    return t.data.start - layout.data_start


@pytest.mark.parametrize("tensor, field, value, code, message", [
    # the offset: aligned, and inside the file
    ("blk.0.attn_k.weight", "offset", lambda L, t: own_offset(L, t) + 4, "Q",
     "at data offset {value} is not aligned to 32 bytes"),
    ("blk.0.attn_q.weight", "offset", lambda L, t: L.size, "Q", "runs past the end of the file"),
    # the byte size that type and shape give must be the bytes the writer put there
    ("blk.0.attn_norm.weight", "dim0", 32, "Q", "128 bytes after tensor 'blk.0.attn_norm.weight' belong to no tensor"),
    ("blk.0.attn_norm.weight", "dim0", 128, "Q", "overlaps tensor 'blk.0.attn_norm.weight'"),
    ("blk.0.attn_q.weight", "type_id", int(GGMLQuantizationType.Q4_0), "I",  # 18 bytes a block, not 34
     "after tensor 'blk.0.attn_q.weight' belong to no tensor"),
    # dims themselves
    ("blk.0.attn_q.weight", "n_dims", 0, "I", "has 0 dims (GGUF allows 1 to 4)"),
    ("blk.0.attn_q.weight", "n_dims", 5, "I", "has 5 dims (GGUF allows 1 to 4)"),
    ("blk.0.attn_q.weight", "n_dims", 2**32 - 1, "I", "has 4294967295 dims (GGUF allows 1 to 4)"),
    ("blk.0.attn_q.weight", "dim1", 0, "Q", "has shape [0, 64]: every dim must be at least 1"),
    ("blk.0.attn_q.weight", "dim1", 2**62, "Q", "and at most 2^63-1 elements in all"),
    ("blk.0.attn_q.weight", "dim0", 48, "Q", "has rows of 48 values, not a whole number of Q8_0 blocks"),
], ids=["misaligned", "past-the-end", "smaller", "larger", "type-size", "n_dims-0", "n_dims-5", "n_dims-huge",
        "dim-0", "elements-overflow", "partial-block"])
def test_a_tensor_info_that_disagrees_with_the_data(demo_gguf, demo_layout, tmp_path, tensor, field, value, code,
                                                    message):
    t = demo_layout.tensors[tensor]
    span = t.dim_fields[int(field[-1])] if field.startswith("dim") else getattr(t, field)
    value = value(demo_layout, t) if callable(value) else value
    line = open_error(demo_patched(demo_gguf, tmp_path / "t.gguf", span, value, code))
    assert f"tensor '{tensor}'" in line and message.format(value=value) in line


def test_overlapping_tensors(demo_gguf, demo_layout, tmp_path):
    k, v = demo_layout.tensors["blk.0.attn_k.weight"], demo_layout.tensors["blk.0.attn_v.weight"]
    line = open_error(demo_patched(demo_gguf, tmp_path / "o.gguf", v.offset, own_offset(demo_layout, k), "Q"))
    assert "tensor 'blk.0.attn_v.weight' overlaps tensor 'blk.0.attn_k.weight'" in line or \
           "tensor 'blk.0.attn_k.weight' overlaps tensor 'blk.0.attn_v.weight'" in line


def test_a_tensor_count_one_short_leaves_bytes_after_the_last_tensor(demo_gguf, demo_layout, tmp_path):
    """The dropped tensor info shifts the data section; its bytes are left over at the end."""
    count = len(demo_layout.tensors) - 1
    line = open_error(demo_patched(demo_gguf, tmp_path / "c.gguf", demo_layout.tensor_count, count, "Q"))
    assert "after the last tensor" in line and "belong to no tensor" in line


def test_junk_after_the_last_tensor(demo_gguf, tmp_path):
    path = tmp_path / "j.gguf"
    path.write_bytes(demo_gguf.read_bytes() + bytes(64))
    assert "64 bytes after the last tensor, 'output.weight', belong to no tensor" in open_error(path)


@pytest.mark.parametrize("key, field, value, code, message", [
    ("qwen3moe.block_count", "type_id", 99, "I", "metadata key 'qwen3moe.block_count' has unknown value type 99"),
    ("tokenizer.ggml.token_type", "item_type", 99, "I",
     "metadata key 'tokenizer.ggml.token_type''s items has unknown value type 99"),
    ("tokenizer.ggml.token_type", "count", 2**61, "Q",  # refused before a list of 2^61 is started
     f"metadata key 'tokenizer.ggml.token_type': item count {2**61} needs at least {2**63} bytes"),
    ("tokenizer.ggml.tokens", "count", 2**61, "Q", f"'tokenizer.ggml.tokens': item count {2**61} needs at least"),
    ("general.name", "string_length", 2**63, "Q", "metadata key 'general.name' runs past the end of the file"),
    ("general.name", "key_name", 0xFF, "B", "metadata key #1 is not UTF-8"),
], ids=["value-type", "item-type", "array-count", "string-array-count", "string-length", "key-not-utf8"])
def test_a_metadata_field_that_cannot_be(demo_gguf, demo_layout, tmp_path, key, field, value, code, message):
    span = getattr(demo_layout.kvs[key], field)
    assert message in open_error(demo_patched(demo_gguf, tmp_path / "m.gguf", span, value, code))


@pytest.mark.parametrize("field", ["kv_count", "tensor_count"])
def test_counts_beyond_the_file(demo_gguf, demo_layout, tmp_path, field):
    line = open_error(demo_patched(demo_gguf, tmp_path / "c.gguf", getattr(demo_layout, field), 2**40, "Q"))
    assert f"{field} {2**40} needs at least" in line


def test_a_key_name_that_is_not_utf8(demo_gguf, demo_layout, tmp_path):
    kv = demo_layout.kvs["general.name"]
    line = open_error(demo_patched(demo_gguf, tmp_path / "u.gguf", kv.key_name, 0xFF, "B"))
    assert "metadata key #1 is not UTF-8" in line


def test_an_empty_tensor_name(demo_gguf, demo_layout, tmp_path):
    """The name's bytes then read as n_dims etc.; the error names the tensor by position."""
    t = demo_layout.tensors["token_embd.weight"]
    line = open_error(demo_patched(demo_gguf, tmp_path / "e.gguf", t.name_length, 0, "Q"))
    assert "tensor #0's name is empty" in line


def test_arrays_nested_too_deep(tmp_path):
    w = GGUFWriter(str(tmp_path / "deep.gguf"), "qwen3moe")
    w.add_array("test.deep", [[[[[1]]]]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "metadata key 'test.deep' nests arrays more than 4 deep" in open_error(tmp_path / "deep.gguf")


def test_typed_reads_name_the_key_and_both_types(tmp_path):
    g = GGUFFile(write_gguf(tmp_path / "t.gguf"))
    assert g.value("test.u32", int) == 4_000_000_000 and g.value("test.f32", float) == g.metadata["test.f32"]
    assert g.value("test.absent", int, 7) == 7 and g.value("test.tokens", list)[0] == "<s>"
    with pytest.raises(GGUFError, match=r"t.gguf: metadata key 'test.f32' is FLOAT32, expected an integer"):
        g.value("test.f32", int)
    with pytest.raises(GGUFError, match=r"metadata key 'test.u8' is UINT8, expected a float"):
        g.value("test.u8", float)
    with pytest.raises(GGUFError, match=r"metadata key 'test.bool' is BOOL, expected an integer"):
        g.value("test.bool", int)
    with pytest.raises(GGUFError, match=r"missing metadata key 'test.absent'"):
        g.value("test.absent", int)


def test_shape_is_checked_and_leading_ones_do_not_count(tmp_path):
    g = GGUFFile(write_gguf(tmp_path / "t.gguf"))
    assert g.tensor("f32", (3, 4)).shape == (3, 4)
    assert g.tensor("q8", (1, 2, 32)).data.shape == (1, 2, 34)  # ggml's trailing 1, llama-quantize drops it
    with pytest.raises(GGUFError, match=r"tensor 'f32' has shape \[3, 4\], but the hyper-parameters give \[4, 3\]"):
        g.tensor("f32", (4, 3))
