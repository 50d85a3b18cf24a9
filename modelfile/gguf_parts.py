"""A model split by llama-gguf-split: finding its parts from the first one, and checking they belong.

Large models are published as `<prefix>-00001-of-00003.gguf`, `...-00002-of-00003.gguf`, ...
Every part is a whole GGUF file with its own header, tensor infos and data section. The first part
holds all the model's metadata plus `split.no` (0), `split.count` and `split.tensors.count` (tensors
over all parts); later parts hold only the three split keys and their own tensors. As llama.cpp
does, the model is named by its first part and the others are found by that naming pattern.

A set of parts that does not fit together fails with one line naming the file at fault: a part
missing, renamed or reordered (its `split.no` is not its place), from another split (its counts or
tensors disagree with the first part's), or an extra file beside the set that the pattern also
matches. llama.cpp ignores such extras; they are refused here, since a leftover of another split
beside the parts is how a set gets mixed up, and the operator should know which files are in use.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from splitmoe.modelfile.gguf_file import _INT_TYPES, GGUFError, GGUFPart, open_part

SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS_COUNT = "split.no", "split.count", "split.tensors.count"

_PART_NAME = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def part_name(prefix: str, index: int, count: int) -> str:
    """llama-gguf-split's name of part `index` (0-based) of `count`: numbered from 1 in the name."""
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.gguf"


def model_stem(path: str | os.PathLike) -> str:
    """The model's name from its file: the stem, without a split part's '-00001-of-00003'."""
    match = _PART_NAME.match(Path(path).name)
    return match["prefix"] if match else Path(path).stem


def open_later_parts(first: GGUFPart) -> list[GGUFPart]:
    """The parts after `first`, opened and checked against it; none for an unsplit file."""
    if SPLIT_COUNT not in first.header.metadata:
        return []
    count, total = _split_int(first, SPLIT_COUNT), _split_int(first, SPLIT_TENSORS_COUNT)
    index = _split_int(first, SPLIT_NO)
    if count == 0 and index == 0:
        # `llama-gguf-split --merge` output: the first part's keys kept, the count zeroed so the
        # tool never merges it again; llama.cpp's loader takes a count under 2 as one file.
        _check_tensors([first], total)
        return []
    if count < 1 or not 0 <= index < count:
        raise GGUFError(f"{first.path.name}: metadata key {SPLIT_NO!r} = {index} with {SPLIT_COUNT!r} = {count} "
                        "is no part of a split")
    prefix = _prefix(first.path, index, count)
    if index != 0:
        raise GGUFError(f"{first.path.name}: part {index + 1} of {count} of a split model; pass the first part, "
                        f"{part_name(prefix, 0, count) if prefix else 'the one whose split.no is 0'}")
    if count > 1 and prefix is None:
        raise GGUFError(f"{first.path.name}: the first of {count} parts, but not named like "
                        f"'<prefix>-00001-of-{count:05d}.gguf', so the others cannot be found")
    paths = [first.path.with_name(part_name(prefix, i, count)) for i in range(1, count)] if prefix else []
    _refuse_extras(first.path, paths, prefix)
    later = [_open_later(path, i + 1, count, total, first) for i, path in enumerate(paths)]
    _check_tensors([first, *later], total)
    return later


def _prefix(path: Path, index: int, count: int) -> str | None:
    """The name's prefix where the name says it is part `index` of `count`, else None."""
    match = _PART_NAME.match(path.name)
    if match is None or (int(match["no"]), int(match["count"])) != (index + 1, count):
        return None
    return match["prefix"]


def _refuse_extras(first: Path, paths: list[Path], prefix: str | None) -> None:
    if prefix is None:
        return
    expected = {first.name, *(p.name for p in paths)}
    for candidate in sorted(first.parent.iterdir()):
        match = _PART_NAME.match(candidate.name)
        if match and match["prefix"] == prefix and candidate.name not in expected:
            raise GGUFError(f"{candidate.name}: not one of the {len(expected)} parts of {first.name}, but named "
                            "like one: move it away (a leftover of another split?)")


def _open_later(path: Path, index: int, count: int, total: int, first: GGUFPart) -> GGUFPart:
    if not path.is_file():
        raise GGUFError(f"{path.name}: no such file, part {index + 1} of {count} of {first.path.name}")
    part = open_part(path)
    for key, expected in ((SPLIT_NO, index), (SPLIT_COUNT, count), (SPLIT_TENSORS_COUNT, total)):
        value = _split_int(part, key)
        if value != expected:
            why = "renamed or reordered?" if key == SPLIT_NO else "a part from another split?"
            raise GGUFError(f"{path.name}: metadata key {key!r} = {value}, expected {expected} "
                            f"as part {index + 1} of {first.path.name}'s set: {why}")
    return part


def _split_int(part: GGUFPart, key: str) -> int:
    header = part.header
    value_type = header.value_types.get(key)
    if value_type is None:
        raise GGUFError(f"{part.path.name}: missing metadata key {key!r} (not a part of a split model?)")
    if value_type not in _INT_TYPES:
        raise GGUFError(f"{part.path.name}: metadata key {key!r} is {value_type.name}, expected an integer")
    return header.metadata[key]


def _check_tensors(parts: list[GGUFPart], total: int) -> None:
    """No tensor in two parts, and as many in all as the first part says."""
    owner: dict[str, Path] = {}
    for part in parts:
        for t in part.header.tensors:
            if t.name in owner:
                raise GGUFError(f"{part.path.name}: tensor {t.name!r} is also in {owner[t.name].name}: "
                                "a part from another split?")
            owner[t.name] = part.path
    if len(owner) != total:
        raise GGUFError(f"{parts[0].path.name}: metadata key {SPLIT_TENSORS_COUNT!r} = {total}, but the "
                        f"{len(parts)} parts hold {len(owner)} tensors: a part from another split?")
