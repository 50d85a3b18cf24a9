"""Files made by llama.cpp's own tools, re-quantized by `llama-quantize` to IQ4_XS and split by
`llama-gguf-split` (tests/data/llamacpp/README.md gives the commands):
* the qwen3moe fixture from f32: no row is a multiple of 256, so every IQ4_XS tensor falls back
  to IQ4_NL (the output to Q8_0): a mixed file, kept whole and split in 2 by tensor count;
* the qwen2moe fixture from Q8_0: its 256-wide shared-expert `ffn_down_shexp` rows become real
  IQ4_XS blocks; split in 3 with the first part metadata only, a layout our writer never makes.

The tools are not in CI, so the files they made are committed; the last tests run the tools where
they are found: they remake the committed files, split and re-quantize every served fixture, and
merge our own writer's parts back (`llama-gguf-split --merge`). Split sets, opened from the first part, give logits bit-identical to the
unsplit file, in process and through real expert services; float32 logits match transformers
(float32, eager) on the fixture's checkpoint holding exactly the values the tensors dequantize to.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, LlamaFileType

from splitmoe.cli import main
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.gguf_split import split_gguf
from tests.support.gguf_compare import values
from tests.support.hf_reference import hf_logits, max_abs
from tests.support.hf_to_gguf import _gguf_name
from tests.support.processes import REPO
from tests.test_split_models import FIXTURE_FILES, TOKENS, cli_logits, remote_logits, serve_each, skip_unless_served

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
DATA = REPO / "tests" / "data" / "llamacpp"
QWEN3_WHOLE = DATA / "qwen3moe-iq4_xs.gguf"
QWEN3_SPLIT = DATA / "qwen3moe-by-tensors" / "qwen3moe-iq4_xs-00001-of-00002.gguf"
QWEN2_SPLIT = DATA / "qwen2moe-no-tensor-first" / "qwen2moe-iq4_xs-00001-of-00003.gguf"
FIXTURES = REPO.parent / "shared" / "fixtures"
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"../shared/fixtures not found: {FIXTURES}")
EXACT = 1e-3


def parts(first: Path) -> list[Path]:
    """Every part of the set `first` opens, in order."""
    return sorted(first.parent.glob(first.name.replace("00001-of-", "*-of-")))


def tensor_types(files: list[Path]) -> dict[str, T]:
    return {t.name: T(t.tensor_type) for f in files for t in GGUFReader(f).tensors}


def test_files_hold_what_llama_quantize_made():
    assert int(GGUFReader(QWEN3_WHOLE).fields["general.file_type"].contents()) == LlamaFileType.MOSTLY_IQ4_XS
    qwen3 = tensor_types([QWEN3_WHOLE])
    assert set(qwen3.values()) == {T.IQ4_NL, T.Q8_0, T.F32}  # rows of 128 and 32: the fallbacks
    qwen2 = tensor_types(parts(QWEN2_SPLIT))
    assert qwen2["blk.0.ffn_down_shexp.weight"] == qwen2["blk.1.ffn_down_shexp.weight"] == T.IQ4_XS
    assert qwen2["blk.0.ffn_gate_exps.weight"] == T.IQ4_NL


@pytest.mark.parametrize("first", [QWEN3_SPLIT, QWEN2_SPLIT], ids=lambda p: p.parent.name)
def test_split_sets_are_what_llama_gguf_split_made(first):
    files = parts(first)
    assert len(files) >= 2 and files[0] == first
    assert int(GGUFReader(first).fields["split.count"].contents()) == len(files)
    assert GGUFFile(first).tensor_names == [t.name for f in files for t in GGUFReader(f).tensors]
    if first == QWEN2_SPLIT:
        assert not GGUFReader(first).tensors  # --no-tensor-first-split


def test_split_set_gives_the_unsplit_files_logits(tmp_path):
    assert GGUFFile(QWEN3_SPLIT).tensor_names == GGUFFile(QWEN3_WHOLE).tensor_names
    assert cli_logits(QWEN3_SPLIT, tmp_path / "split.npy") == cli_logits(QWEN3_WHOLE, tmp_path / "whole.npy")


@pytest.mark.stack
def test_split_sets_through_expert_services_give_the_in_process_logits(tmp_path):
    """Two services per file, each half the experts, each opening its set from the first part."""
    models = {"qwen3-whole": QWEN3_WHOLE, "qwen3-split": QWEN3_SPLIT, "qwen2-split": QWEN2_SPLIT}
    services = serve_each(models, tmp_path, halves=True)
    try:
        services.wait()
        got = {name: remote_logits(path, services.address(f"{name}-low"), services.address(f"{name}-high"))
               for name, path in models.items()}
    finally:
        services.stop_all()
    assert got["qwen3-split"] == got["qwen3-whole"]
    # across processes the experts' sums run in another order: equal to rounding, not bit for bit
    for name in ("qwen3-whole", "qwen2-split"):
        cli_logits(models[name], tmp_path / f"{name}.npy")
        in_process = np.load(tmp_path / f"{name}.npy")
        assert max_abs(np.frombuffer(got[name], np.float32).reshape(in_process.shape), in_process) <= 1e-4, name


# ---- against transformers on the exactly dequantized weights -----------------------------------


def dequantized_transformers(arch: str, first: Path) -> torch.nn.Module:
    """The fixture's transformers model holding exactly the values the set's tensors dequantize to
    (read by gguf-py, not our loader). qwen2moe / qwen3moe: the converter permutes nothing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURES / arch / "hf", dtype=torch.float32,
                                                 attn_implementation="eager", experts_implementation="eager")
    tensors = {t.name: torch.from_numpy(values(t).astype(np.float32)) for f in parts(first) for t in GGUFReader(f).tensors}
    state = {name: gguf_value(name, tensors).reshape(p.shape) for name, p in model.state_dict().items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def gguf_value(hf_name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One transformers parameter from GGUF tensors: the fused gate_up experts from two."""
    if m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", hf_name):
        if m[2] == "down_proj":
            return tensors[f"blk.{m[1]}.ffn_down_exps.weight"]
        return torch.cat([tensors[f"blk.{m[1]}.ffn_{p}_exps.weight"] for p in ("gate", "up")], dim=1)
    return tensors[_gguf_name(hf_name)]


def prompts() -> list[list[int]]:
    return [TOKENS] + [p["ids"] for p in json.loads((FIXTURES / "prompts.json").read_text())["prompts"]]


@needs_fixtures
@pytest.mark.parametrize("arch, first", [("qwen3moe", QWEN3_WHOLE), ("qwen2moe", QWEN2_SPLIT)],
                         ids=["qwen3moe-whole", "qwen2moe-split"])
def test_float32_logits_match_transformers_on_the_dequantized_weights(arch, first, tmp_path):
    model = dequantized_transformers(arch, first)
    checkpoint = np.load(FIXTURES / arch / "ref" / "hf_float32_p0.npy")
    assert max_abs(hf_logits(model, prompts()[1]), checkpoint) > 0.1  # it holds the file's 4-bit values
    for i, ids in enumerate(prompts()):
        out = tmp_path / f"p{i}.npy"
        cli_logits_for(first, ids, out)
        assert max_abs(np.load(out), hf_logits(model, ids)) <= EXACT, f"prompt {i}"


def cli_logits_for(model: Path, ids: list[int], out: Path) -> None:
    """`splitmoe logits`, float32 on the CPU, of `ids` (the file's neighbours stay untouched)."""
    assert main(["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(out),
                 "--device", "cpu"]) == 0


# ---- the tools themselves -----------------------------------------------------------------------


def llama_tool(name: str) -> str | None:
    """`name` in $SPLITMOE_LLAMA_CPP_BIN (a llama.cpp build's bin directory), else on PATH."""
    bin_dir = os.environ.get("SPLITMOE_LLAMA_CPP_BIN")
    return shutil.which(name, path=bin_dir) if bin_dir else shutil.which(name)


needs_tools = pytest.mark.skipif(
    not (llama_tool("llama-quantize") and llama_tool("llama-gguf-split")),
    reason="llama.cpp's llama-quantize and llama-gguf-split not found (set SPLITMOE_LLAMA_CPP_BIN to a build's bin directory)")


def run(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def make_files(out: Path) -> None:
    """README.md's commands, into `out` (the unsplit qwen2moe file too, which is not committed)."""
    quantize, split = llama_tool("llama-quantize"), llama_tool("llama-gguf-split")
    run([quantize, str(FIXTURES / "qwen3moe" / "qwen3moe-f32.gguf"), str(out / QWEN3_WHOLE.name), "IQ4_XS"])
    run([quantize, "--allow-requantize", str(FIXTURES / "qwen2moe" / "qwen2moe-q8_0.gguf"),
         str(out / "qwen2moe-iq4_xs.gguf"), "IQ4_XS"])
    for first, options, whole in [(QWEN3_SPLIT, ["--split-max-tensors", "20"], QWEN3_WHOLE.name),
                                  (QWEN2_SPLIT, ["--split-max-tensors", "20", "--no-tensor-first-split"],
                                   "qwen2moe-iq4_xs.gguf")]:
        (out / first.parent.name).mkdir()
        run([split, "--split", *options, str(out / whole), str(out / first.parent.name / whole.removesuffix(".gguf"))])


@pytest.mark.stack
@needs_fixtures
@needs_tools
def test_the_tools_remake_the_committed_files(tmp_path):
    make_files(tmp_path)
    committed = sorted(p.relative_to(DATA) for p in DATA.rglob("*.gguf"))
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.gguf")) == \
        sorted([*committed, Path("qwen2moe-iq4_xs.gguf")])
    for path in committed:
        assert (tmp_path / path).read_bytes() == (DATA / path).read_bytes(), path
    # the qwen2moe set's unsplit self, made here, gives its logits bit for bit
    whole = tmp_path / "qwen2moe-iq4_xs.gguf"
    assert cli_logits(whole, tmp_path / "whole.npy") == cli_logits(QWEN2_SPLIT, tmp_path / "split.npy")


@pytest.mark.stack
@needs_fixtures
@needs_tools
@pytest.mark.parametrize("model", FIXTURE_FILES, ids=lambda p: p.name)
def test_every_fixture_split_by_the_tool_gives_the_unsplit_files_logits(model, tmp_path):
    """Not committed (each set is its fixture's size): checked where the tool is."""
    skip_unless_served(model)
    assert_tool_split_keeps_logits(model, ["--split-max-tensors", "16"], tmp_path)


@pytest.mark.stack
@needs_fixtures
@needs_tools
def test_fixture_split_by_size_gives_the_unsplit_files_logits(tmp_path):
    """--split-max-size counts whole megabytes, and a part must hold a tensor: of the fixtures only the
    4 MB f32 one splits (into 3 at 2M; at 1M its 1 MiB output matrix overflows a part)."""
    assert_tool_split_keeps_logits(FIXTURES / "qwen3moe" / "qwen3moe-f32.gguf", ["--split-max-size", "2M"], tmp_path)


def assert_tool_split_keeps_logits(model: Path, options: list[str], tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    run([llama_tool("llama-gguf-split"), "--split", *options, str(model), str(tmp_path / model.stem)])
    made = sorted(tmp_path.glob("*.gguf"))
    assert len(made) >= 2 and made[0].name == f"{model.stem}-00001-of-{len(made):05d}.gguf"
    assert cli_logits(made[0], tmp_path / "split.npy") == cli_logits(model, tmp_path / "whole.npy")


Q8_0_FIXTURES = [p for p in FIXTURE_FILES if p.name.endswith("-q8_0.gguf")]


@pytest.mark.stack
@needs_fixtures
@needs_tools
@pytest.mark.parametrize("model", Q8_0_FIXTURES, ids=lambda p: p.parent.name)
def test_every_fixture_requantized_to_iq4_xs_and_split_by_the_tools_keeps_its_logits(model, tmp_path):
    """Every architecture through both tools (deepseek2's 256-wide dense `ffn_down` becomes real
    IQ4_XS); no transformers reference here, the committed qwen files carry that."""
    skip_unless_served(model)
    whole = tmp_path / "whole" / model.name.replace("q8_0", "iq4_xs")
    whole.parent.mkdir()
    run([llama_tool("llama-quantize"), "--allow-requantize", str(model), str(whole), "IQ4_XS"])
    assert T.IQ4_NL in set(tensor_types([whole]).values())
    assert_tool_split_keeps_logits(whole, ["--split-max-tensors", "16"], tmp_path / "split")


@pytest.mark.stack
@needs_fixtures
@needs_tools
@pytest.mark.parametrize("model", Q8_0_FIXTURES, ids=lambda p: p.parent.name)
def test_llama_gguf_split_merges_our_parts_back_to_the_same_logits(model, tmp_path):
    """The other way round: llama.cpp's tool reads the parts our writer makes."""
    skip_unless_served(model)
    first = split_gguf(model, tmp_path / model.stem, 3)[0]
    merged = tmp_path / "merged" / model.name
    merged.parent.mkdir()
    run([llama_tool("llama-gguf-split"), "--merge", str(first), str(merged)])
    assert cli_logits(merged, tmp_path / "merged.npy") == cli_logits(model, tmp_path / "whole.npy")
