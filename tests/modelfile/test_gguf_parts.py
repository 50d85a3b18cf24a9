"""Split GGUF files (llama-gguf-split's format): our writer, the loader that opens a set from its
first part, and the one-line errors for sets of parts that do not fit together.

End to end (logits through `splitmoe logits` and through the services) is in tests/test_split_models.py.
"""
from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from splitmoe.modelfile.expert_tensors import ExpertShard, moe_layers
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.gguf_parts import model_stem, part_name
from splitmoe.modelfile.gguf_split import split_gguf

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
FIXTURE_FILES = sorted(FIXTURES.glob("*/*.gguf")) if FIXTURES.is_dir() else []


def assert_same_model(split: GGUFFile, whole: GGUFFile) -> None:
    """The same metadata (plus the split keys) and tensors, each a view of the part that holds it."""
    assert {k: v for k, v in split.metadata.items() if not k.startswith("split.")} == whole.metadata
    assert split.tensor_names == whole.tensor_names
    holders = {t.name: path.name for path in split.parts for t in GGUFReader(path, "r").tensors}
    for name in whole.tensor_names:
        got, expected = split.tensor(name), whole.tensor(name)
        assert (got.ggml_type, got.shape) == (expected.ggml_type, expected.shape)
        assert np.array_equal(got.data, expected.data, equal_nan=True), name
        assert isinstance(got.data, np.memmap) and not got.data.flags.writeable
        assert Path(got.data.filename).name == holders[name], name


@pytest.mark.skipif(not FIXTURE_FILES, reason=f"../shared/fixtures not found: {FIXTURES}")
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name)
def test_fixtures_split_read_as_the_whole_file(path, parts, tmp_path):
    paths = split_gguf(path, tmp_path / path.stem, parts)
    split = GGUFFile(paths[0])
    assert split.parts == paths
    assert_same_model(split, GGUFFile(path))


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_demo_model_split_reads_as_the_whole_file(demo_gguf, parts, tmp_path):
    paths = split_gguf(demo_gguf, tmp_path / "demo", parts)
    assert [p.name for p in paths] == [f"demo-{i:05d}-of-{parts:05d}.gguf" for i in range(1, parts + 1)]
    assert_same_model(GGUFFile(paths[0]), GGUFFile(demo_gguf))


def test_parts_follow_llama_gguf_split_format(demo_gguf, tmp_path):
    """Read back by gguf-py: the first part has all metadata and the split keys, later ones only those."""
    paths = split_gguf(demo_gguf, tmp_path / "demo", 3)
    whole = GGUFReader(demo_gguf, "r")
    readers = [GGUFReader(p, "r") for p in paths]
    user_keys = [k for k in whole.fields if not k.startswith("GGUF.")]
    split_types = {"split.no": GGUFValueType.UINT16, "split.count": GGUFValueType.UINT16,
                   "split.tensors.count": GGUFValueType.INT32}
    for i, r in enumerate(readers):
        keys = [k for k in r.fields if not k.startswith("GGUF.")]
        assert keys == (user_keys if i == 0 else []) + list(split_types)
        for key, value_type in split_types.items():
            assert r.fields[key].types == [value_type]
        assert [r.fields[k].contents() for k in split_types] == [i, 3, len(whole.tensors)]
    assert [t.name for r in readers for t in r.tensors] == [t.name for t in whole.tensors]
    assert all(r.tensors for r in readers)


def test_first_part_without_tensors(demo_gguf, tmp_path):
    """`llama-gguf-split --no-tensor-first-split`: the first part is metadata only."""
    paths = split_gguf(demo_gguf, tmp_path / "demo", 3, metadata_only_first=True)
    assert not GGUFReader(paths[0], "r").tensors
    assert_same_model(GGUFFile(paths[0]), GGUFFile(demo_gguf))


def test_file_id_covers_every_part(demo_gguf, tmp_path):
    paths = split_gguf(demo_gguf, tmp_path / "demo", 3)
    sizes = [p.stat().st_size for p in paths]
    assert GGUFFile(paths[0]).file_id == f"demo-00001-of-00003.gguf:{sizes[0]}+{sizes[1]}+{sizes[2]}"
    assert GGUFFile(demo_gguf).file_id == f"demo.gguf:{demo_gguf.stat().st_size}"  # unsplit: as before


def test_model_stem_drops_the_part_number():
    """What the services call the model when no name is given: the set's name, not its first file's."""
    assert model_stem("/m/gpt-oss-120b-mxfp4-00001-of-00003.gguf") == "gpt-oss-120b-mxfp4"
    assert model_stem("/m/Qwen3-30B-A3B-Q4_K_M.gguf") == "Qwen3-30B-A3B-Q4_K_M"
    assert model_stem("/m/odd-1-of-3.gguf") == "odd-1-of-3"


def test_expert_shard_views_the_parts_that_hold_its_experts(demo_gguf, tmp_path):
    """The expert service maps every part but touches only its experts' bytes, wherever they are."""
    paths = split_gguf(demo_gguf, tmp_path / "demo", 3)
    split, whole = GGUFFile(paths[0]), GGUFFile(demo_gguf)
    layers = moe_layers(split)
    shard, reference = ExpertShard(split, layers, [1, 6]), ExpertShard(whole, layers, [1, 6])
    files = set()
    for layer in layers:
        for expert, ffn in shard._ffns[layer].items():
            for got, expected in zip((ffn.gate, ffn.up, ffn.down), (reference._ffns[layer][expert].gate,
                                                                     reference._ffns[layer][expert].up,
                                                                     reference._ffns[layer][expert].down)):
                assert isinstance(got.data, np.memmap) and np.array_equal(got.data, expected.data)
                files.add(Path(got.data.filename).name)
    assert len(files) > 1 and files <= {p.name for p in paths}  # the experts live in more than one part


# ---- broken sets: one line naming the file at fault ---------------------------------------------


def error_of(path: Path) -> str:
    with pytest.raises(GGUFError) as e:
        GGUFFile(path)
    message = str(e.value)
    assert "\n" not in message
    return message


@pytest.fixture()
def three(demo_gguf, tmp_path) -> list[Path]:
    return split_gguf(demo_gguf, tmp_path / "demo", 3)


def set_split_key(path: Path, key: str, value: int) -> None:
    """Rewrite one split.* value in place (our writer stores them as u16 / i32)."""
    data = bytearray(path.read_bytes())
    name = struct.pack("<Q", len(key)) + key.encode()
    at = data.index(name) + len(name)
    value_type = GGUFValueType(struct.unpack_from("<I", data, at)[0])
    struct.pack_into("<H" if value_type == GGUFValueType.UINT16 else "<i", data, at + 4, value)
    path.write_bytes(bytes(data))


def test_missing_part(three):
    three[1].unlink()
    assert error_of(three[0]) == ("demo-00002-of-00003.gguf: no such file, part 2 of 3 of "
                                  "demo-00001-of-00003.gguf")


def test_last_part_missing(three):
    three[2].unlink()
    assert error_of(three[0]).startswith("demo-00003-of-00003.gguf: no such file, part 3 of 3")


def test_extra_part_is_refused(three):
    shutil.copy(three[2], three[0].with_name("demo-00004-of-00003.gguf"))
    assert error_of(three[0]).startswith("demo-00004-of-00003.gguf: not one of the 3 parts of "
                                         "demo-00001-of-00003.gguf")


def test_leftover_of_another_split_beside_the_set_is_refused(demo_gguf, three):
    split_gguf(demo_gguf, three[0].with_name("demo"), 2)  # demo-0000?-of-00002.gguf beside the 3 parts
    assert error_of(three[0]).startswith("demo-00001-of-00002.gguf: not one of the 3 parts")
    # and the other way round
    assert error_of(three[0].with_name("demo-00001-of-00002.gguf")).startswith("demo-00001-of-00003.gguf: not one")


def test_reordered_parts(three):
    swap = three[1].with_name("swap.tmp")
    three[1].rename(swap)
    three[2].rename(three[1])
    swap.rename(three[2])
    assert error_of(three[0]) == ("demo-00002-of-00003.gguf: metadata key 'split.no' = 2, expected 1 as part 2 of "
                                  "demo-00001-of-00003.gguf's set: renamed or reordered?")


def test_part_from_another_split_of_the_same_count(demo_gguf, three, tmp_path):
    """Split at other boundaries (first part metadata only): its part 2 overlaps ours."""
    other = split_gguf(demo_gguf, tmp_path / "other", 3, metadata_only_first=True)
    shutil.copy(other[1], three[1])
    assert "demo-00002-of-00003.gguf: tensor " in error_of(three[0])
    assert error_of(three[0]).endswith("a part from another split?")


def test_part_from_another_model(demo_gguf, three, tmp_path):
    """Another model's part 2 of 3: its tensor total differs from the first part's."""
    smaller = tmp_path / "smaller.gguf"
    from tests.support.gguf_edit import rewrite_gguf
    rewrite_gguf(demo_gguf, smaller, drop_tensors=("output.weight",))
    other = split_gguf(smaller, tmp_path / "other", 3)
    shutil.copy(other[1], three[1])
    message = error_of(three[0])
    assert message.startswith("demo-00002-of-00003.gguf: metadata key 'split.tensors.count' = ")
    assert message.endswith("a part from another split?")


def test_mismatched_split_count(three):
    set_split_key(three[2], "split.count", 4)
    assert error_of(three[0]) == ("demo-00003-of-00003.gguf: metadata key 'split.count' = 4, expected 3 as part 3 "
                                  "of demo-00001-of-00003.gguf's set: a part from another split?")


def test_tensor_total_mismatch(three):
    """Every part agrees on a total the parts do not hold."""
    total = GGUFReader(three[0], "r").fields["split.tensors.count"].contents()
    for p in three:
        set_split_key(p, "split.tensors.count", total + 1)
    assert error_of(three[0]) == (f"demo-00001-of-00003.gguf: metadata key 'split.tensors.count' = {total + 1}, "
                                  f"but the 3 parts hold {total} tensors: a part from another split?")


def test_passing_a_later_part_names_the_first(three):
    assert error_of(three[1]) == ("demo-00002-of-00003.gguf: part 2 of 3 of a split model; pass the first part, "
                                  "demo-00001-of-00003.gguf")


def test_first_part_renamed(three):
    renamed = three[0].with_name("demo.gguf")
    three[0].rename(renamed)
    assert error_of(renamed) == ("demo.gguf: the first of 3 parts, but not named like '<prefix>-00001-of-00003.gguf', "
                                 "so the others cannot be found")


def test_later_part_without_split_keys(demo_gguf, three):
    shutil.copy(demo_gguf, three[1])  # an unsplit file under a part's name
    assert error_of(three[0]) == ("demo-00002-of-00003.gguf: missing metadata key 'split.no' "
                                  "(not a part of a split model?)")


def test_broken_later_part_names_it(three):
    with open(three[2], "r+b") as f:
        f.truncate(three[2].stat().st_size - 64)
    message = error_of(three[2].with_name(part_name("demo", 0, 3)))
    assert message.startswith("demo-00003-of-00003.gguf: ") and "truncated" in message


def test_split_no_out_of_range(three):
    set_split_key(three[0], "split.no", 5)
    assert error_of(three[0]) == ("demo-00001-of-00003.gguf: metadata key 'split.no' = 5 with 'split.count' = 3 "
                                  "is no part of a split")


def test_file_merged_by_llama_gguf_split_opens_as_one(demo_gguf, tmp_path):
    """`llama-gguf-split --merge` keeps the first part's split keys with split.count 0."""
    merged = split_gguf(demo_gguf, tmp_path / "merged", 1)[0]
    set_split_key(merged, "split.count", 0)
    assert GGUFFile(merged).tensor_names == GGUFFile(demo_gguf).tensor_names


def test_merged_file_missing_tensors(demo_gguf, tmp_path):
    merged = split_gguf(demo_gguf, tmp_path / "merged", 1)[0]
    set_split_key(merged, "split.count", 0)
    set_split_key(merged, "split.tensors.count", 999)
    assert "metadata key 'split.tensors.count' = 999, but the 1 parts hold" in error_of(merged)
