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

from modelfile.gguf_file import GGUFError, GGUFFile

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
