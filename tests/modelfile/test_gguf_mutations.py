"""Seeded mutants of the demo GGUF through the real loading path: each fails with one line naming
the file and the key or tensor (exit 2), or loads and gives logits bit-identical to the original's.

Each family of mutations aims, through the file's parsed layout (tests/support/gguf_layout.py,
read by gguf-py), at one region: truncations anywhere; the header's magic, version and counts;
the metadata's key lengths, value types, string lengths, array item types and counts; the
hyper-parameters, set to values the tensors contradict or no model has; every field of the
tensor infos (name length, n_dims, each dim, type, offset, dims transposed); random byte flips
over header, metadata and tensor infos; junk appended after the data.

What is left out, and why: a GGUF file has no checksum, so bytes that only say *which* valid model
the file is cannot be told from the original by any reader. That is tensor data (weights: a
flipped byte is another weight), the values of the hyper-parameters no tensor's shape depends on
(`rope.freq_base`, `layer_norm_rms_epsilon`, `expert_used_count`: flipped, they are another valid
model), and the name of `rope.freq_base` (renamed, the key is absent and its default applies).
Out-of-range values of those same keys are in the hyper-parameter family: they must be refused.

Most mutants run `splitmoe.cli.main` in this process; a sample runs `python -m splitmoe logits`
as a subprocess, so the exit code, the one line on stderr and the absence of a signal are those
a user sees.
"""
from __future__ import annotations

import contextlib
import io
import math
import random
import re
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from splitmoe.cli import main
from tests.support.gguf_layout import Layout, Span, read_layout

SEED = 10
TOKEN_IDS = "1,2,3,100,274"
REPO = Path(__file__).resolve().parents[2]

# Values no tensor shape depends on: another value is another valid model (see the docstring).
MODEL_DEFINING_VALUES = ("qwen3moe.rope.freq_base", "qwen3moe.attention.layer_norm_rms_epsilon",
                         "qwen3moe.expert_used_count")
OPTIONAL_KEYS_WITH_ANOTHER_DEFAULT = ("qwen3moe.rope.freq_base",)
# Integer hyper-parameters the tensors' shapes (or their presence) pin down.
SHAPE_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
              "attention.key_length", "attention.value_length", "expert_count", "expert_feed_forward_length",
              "vocab_size")
ABSURD_INTS = (0, 2**31 - 1, 2**32 - 1)
ABSURD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0)
# What a one-line error may name instead of a quoted key or tensor name: a header field, or a key
# or tensor by its position where its name itself cannot be read ("tensor #14's name").
HEADER_WORDS = ("header", "magic", "version", "tensor_count", "kv_count")


@dataclass(frozen=True)
class Mutant:
    family: str
    what: str
    data: bytes


class Mutator:
    def __init__(self, original: bytes, layout: Layout, rng: random.Random):
        self.original, self.layout, self.rng = original, layout, rng

    def put(self, span: Span, value: int | float, code: str) -> bytes:
        data = bytearray(self.original)
        struct.pack_into("<" + code, data, span.start, value)
        return bytes(data)

    def pick(self, items):
        return self.rng.choice(sorted(items) if isinstance(items, (set, dict)) else list(items))

    # ---- families -------------------------------------------------------------------------------

    def truncations(self, n: int):
        L = self.layout
        regions = [Span(0, 24), L.metadata, L.tensor_infos, Span(L.data_start, L.size - L.data_start)]
        for i in range(n):
            region = regions[i % len(regions)]
            cut = self.rng.randrange(region.start, region.end)
            yield Mutant("truncate", f"cut at byte {cut}", self.original[:cut])

    def header(self):
        L = self.layout
        flip = bytearray(self.original)
        flip[self.rng.randrange(4)] ^= 0x20
        yield Mutant("header", "magic byte flipped", bytes(flip))
        for version in (0, 1, 4, 0x10000):
            yield Mutant("header", f"version {version}", self.put(L.version, version, "I"))
        n_tensors, n_kvs = len(L.tensors), len(L.kvs)
        for count in (n_tensors - 1, n_tensors + 1, 0, 2**32 + n_tensors, 2**63):
            yield Mutant("header", f"tensor_count {count}", self.put(L.tensor_count, count, "Q"))
        for count in (n_kvs - 1, n_kvs + 1, 0, 2**40):
            yield Mutant("header", f"kv_count {count}", self.put(L.kv_count, count, "Q"))

    def metadata_structure(self, n: int):
        kvs = self.layout.kvs
        for _ in range(n):
            kv = kvs[self.pick(kvs)]
            choices = ["key_length", "value_type"]
            if kv.string_length:
                choices.append("string_length")
            if kv.count:
                choices += ["item_type", "count"]
            field = self.rng.choice(choices)
            if field == "key_length":
                length = self.rng.choice([kv.key_name.size - 1, kv.key_name.size + 1, 0, 2**62])
                yield Mutant("metadata", f"{kv.key}: key length {length}", self.put(kv.key_length, length, "Q"))
            elif field == "value_type":
                vtype = self.rng.choice([t for t in range(14) if t != kv.value_type] + [14, 255, 2**31])
                yield Mutant("metadata", f"{kv.key}: value type {vtype}", self.put(kv.type_id, vtype, "I"))
            elif field == "string_length":
                size = kv.value.size - 8
                length = self.rng.choice([size - 1, size + 1, 2**40, 2**64 - 1])
                yield Mutant("metadata", f"{kv.key}: string length {length}",
                             self.put(kv.string_length, length, "Q"))
            elif field == "item_type":
                itype = self.rng.choice([t for t in range(13)] + [13, 99])
                yield Mutant("metadata", f"{kv.key}: item type {itype}", self.put(kv.item_type, itype, "I"))
            else:
                count = struct.unpack_from("<Q", self.original, kv.count.start)[0]
                new = self.rng.choice([count - 1, count + 1, 0, 2**31, 2**63])
                yield Mutant("metadata", f"{kv.key}: item count {new}", self.put(kv.count, new, "Q"))

    def hyper_parameters(self):
        kvs = self.layout.kvs
        for key in SHAPE_KEYS:
            kv = kvs[f"qwen3moe.{key}"]
            value = struct.unpack_from("<I", self.original, kv.value.start)[0]
            for new in (value - 1, value + 1, 2 * value, self.pick(ABSURD_INTS)):
                yield Mutant("hparams", f"{kv.key} = {new}", self.put(kv.value, new, "I"))
        experts = struct.unpack_from("<I", self.original, kvs["qwen3moe.expert_count"].value.start)[0]
        for new in (*ABSURD_INTS, experts + 1):
            kv = kvs["qwen3moe.expert_used_count"]
            yield Mutant("hparams", f"{kv.key} = {new}", self.put(kv.value, new, "I"))
        for key in ("qwen3moe.rope.freq_base", "qwen3moe.attention.layer_norm_rms_epsilon"):
            for new in ABSURD_FLOATS:
                yield Mutant("hparams", f"{key} = {new}", self.put(kvs[key].value, new, "f"))

    def tensor_infos(self, n: int):
        L = self.layout
        names = sorted(L.tensors)
        offsets = sorted(t.data.start - L.data_start for t in L.tensors.values())
        for _ in range(n):
            t = L.tensors[self.rng.choice(names)]
            field = self.rng.choice(["name_length", "n_dims", "dim", "transpose", "type", "offset", "offset"])
            if field == "name_length":
                length = self.rng.choice([t.name_bytes.size - 1, t.name_bytes.size + 1, 0, 2**50])
                yield Mutant("tensors", f"{t.name}: name length {length}", self.put(t.name_length, length, "Q"))
            elif field == "n_dims":
                n_dims = self.rng.choice([d for d in range(6) if d != len(t.dims)] + [2**32 - 1])
                yield Mutant("tensors", f"{t.name}: n_dims {n_dims}", self.put(t.n_dims, n_dims, "I"))
            elif field == "dim":
                i = self.rng.randrange(len(t.dims))
                d = t.dims[i]
                new = self.rng.choice([0, d - 1, d + 1, 2 * d, d // 2, 2**31, 2**63, 2**64 - 1])
                yield Mutant("tensors", f"{t.name}: dim {i} = {new}", self.put(t.dim_fields[i], new, "Q"))
            elif field == "transpose" and len(t.dims) >= 2 and t.dims[0] != t.dims[1]:
                data = bytearray(self.original)
                struct.pack_into("<QQ", data, t.dim_fields[0].start, t.dims[1], t.dims[0])
                yield Mutant("tensors", f"{t.name}: dims transposed", bytes(data))
            elif field == "type":
                known = [int(q) for q in GGML_QUANT_SIZES if q != t.ggml_type]
                new = self.rng.choice(known + [31, 99, 2**31])
                yield Mutant("tensors", f"{t.name}: type {new}", self.put(t.type_id, new, "I"))
            else:
                own = t.data.start - L.data_start
                new = self.rng.choice([own + 1, own + L.alignment, own - L.alignment, own + t.data.size + 31,
                                       self.rng.choice(offsets), L.size, 2**63, 2**64 - 1])
                if new < 0:
                    new = own + 1
                yield Mutant("tensors", f"{t.name}: offset {new}", self.put(t.offset, new, "Q"))

    def byte_flips(self, n: int):
        """Random bytes of header, metadata and tensor infos, less those that define another model."""
        L = self.layout
        excluded: set[int] = set()
        for key in MODEL_DEFINING_VALUES:
            excluded.update(range(L.kvs[key].value.start, L.kvs[key].value.end))
        for key in OPTIONAL_KEYS_WITH_ANOTHER_DEFAULT:
            excluded.update(range(L.kvs[key].key_name.start, L.kvs[key].key_name.end))
        end = L.tensor_infos.end
        for _ in range(n):
            at = self.rng.randrange(end)
            while at in excluded:
                at = self.rng.randrange(end)
            data = bytearray(self.original)
            data[at] ^= self.rng.randrange(1, 256)
            yield Mutant("flip", f"byte {at} ^= {data[at] ^ self.original[at]:#04x}", bytes(data))

    def appended(self):
        for n in (self.layout.alignment, 1000):
            yield Mutant("data", f"{n} junk bytes appended", self.original + bytes(range(256)) * (n // 256) +
                         bytes(n % 256))


def all_mutants(original: bytes, layout: Layout) -> list[Mutant]:
    m = Mutator(original, layout, random.Random(SEED))
    return [*m.truncations(12), *m.header(), *m.metadata_structure(24), *m.hyper_parameters(),
            *m.tensor_infos(40), *m.byte_flips(30), *m.appended()]


# ---- the checks ---------------------------------------------------------------------------------


def check_outcome(mutant: Mutant, code: int, stderr: str, out: Path, expected: np.ndarray, file_name: str) -> str:
    """'loads' or 'fails' if the outcome is allowed; the assertion says which mutant it was when not."""
    where = f"{mutant.family}: {mutant.what}"
    assert "Traceback" not in stderr, f"{where}: a traceback\n{stderr}"
    if code == 0:
        logits = np.load(out)
        assert logits.shape == expected.shape and np.array_equal(logits, expected), \
            f"{where}: loaded, with other logits"
        return "loads"
    lines = stderr.strip().splitlines()
    assert code == 2, f"{where}: exit code {code}\n{stderr}"
    assert len(lines) == 1, f"{where}: not one line\n{stderr}"
    line = lines[0]
    assert line.startswith(f"splitmoe logits: error: {file_name}: "), f"{where}: {line}"
    message = line.removeprefix(f"splitmoe logits: error: {file_name}: ")
    assert re.search(r"'[^']+'|\"[^\"]+\"|#\d+", message) or any(w in message for w in HEADER_WORDS), \
        f"{where}: names no key or tensor: {line}"
    return "fails"


def run_in_process(path: Path, out: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["logits", str(path), "--token-ids", TOKEN_IDS, "--out", str(out)])
    return code, err.getvalue()


@pytest.fixture(scope="module")
def original(demo_gguf, tmp_path_factory) -> tuple[bytes, Layout, np.ndarray]:
    out = tmp_path_factory.mktemp("logits") / "original.npy"
    code, err = run_in_process(demo_gguf, out)
    assert code == 0, err
    return demo_gguf.read_bytes(), read_layout(demo_gguf), np.load(out)


def test_every_mutant_fails_with_one_line_or_loads_the_same_model(original, tmp_path):
    data, layout, expected = original
    mutants = all_mutants(data, layout)
    assert len(mutants) >= 100
    outcomes: dict[str, dict[str, int]] = {}
    for i, mutant in enumerate(mutants):
        path, out = tmp_path / "mutant.gguf", tmp_path / f"logits-{i}.npy"
        path.write_bytes(mutant.data)
        code, stderr = run_in_process(path, out)
        outcome = check_outcome(mutant, code, stderr, out, expected, path.name)
        family = outcomes.setdefault(mutant.family, {"loads": 0, "fails": 0})
        family[outcome] += 1
    # Each family reached its region: most of its mutants were caught there.
    for family, counts in outcomes.items():
        assert counts["fails"] > counts["loads"], (family, counts)


@pytest.mark.stack
def test_a_sample_of_mutants_as_a_user_runs_them(original, tmp_path):
    """`python -m splitmoe logits` in a subprocess, several at once: exit code, stderr, no signal."""
    data, layout, expected = original
    mutants = all_mutants(data, layout)
    rng = random.Random(SEED)
    sample = rng.sample([m for m in mutants if m.family != "flip"], 3) + rng.sample(
        [m for m in mutants if m.family == "flip"], 1)
    runs = []
    for i, mutant in enumerate(sample):
        path, out = tmp_path / f"mutant{i}.gguf", tmp_path / f"logits{i}.npy"
        path.write_bytes(mutant.data)
        proc = subprocess.Popen([sys.executable, "-m", "splitmoe", "logits", str(path), "--token-ids", TOKEN_IDS,
                                 "--out", str(out)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        runs.append((mutant, proc, path, out))
    for mutant, proc, path, out in runs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode >= 0, f"{mutant.what}: killed by signal {-proc.returncode}"
        check_outcome(mutant, proc.returncode, stderr, out, expected, path.name)
