"""Broken or unsupported GGUF files fail with one clear line naming the key or tensor."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from splitmoe.cli import main
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from tests.support.gguf_edit import rewrite_gguf

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO.parent / "shared" / "fixtures"


def logits_error(path, tmp_path, capsys) -> str:
    code = main(["logits", str(path), "--token-ids", "1,2,3", "--out", str(tmp_path / "x.npy")])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_the_valid_demo_model_loads(demo_gguf, tmp_path):
    assert main(["logits", str(demo_gguf), "--token-ids", "1,2,3", "--out", str(tmp_path / "x.npy")]) == 0
    assert np.load(tmp_path / "x.npy").shape == (3, 275)


def test_not_a_gguf(tmp_path, capsys):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model" * 100)
    assert "not a readable GGUF file" in logits_error(path, tmp_path, capsys)


def test_truncated_file(demo_gguf, tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    data = demo_gguf.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    line = logits_error(path, tmp_path, capsys)
    assert "cut.gguf" in line and ("truncated" in line or "not a readable GGUF" in line)


def test_truncated_inside_metadata(demo_gguf, tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    path.write_bytes(demo_gguf.read_bytes()[:2000])
    assert "cut.gguf" in logits_error(path, tmp_path, capsys)


def test_unknown_architecture(demo_gguf, tmp_path, capsys):
    path = tmp_path / "arch.gguf"
    rewrite_gguf(demo_gguf, path, arch="mamba")
    line = logits_error(path, tmp_path, capsys)
    assert "'mamba'" in line and "not supported" in line


def test_missing_key(demo_gguf, tmp_path, capsys):
    path = tmp_path / "key.gguf"
    rewrite_gguf(demo_gguf, path, drop_keys=("qwen3moe.embedding_length",))
    assert "missing metadata key 'qwen3moe.embedding_length'" in logits_error(path, tmp_path, capsys)


def test_missing_tensor(demo_gguf, tmp_path, capsys):
    path = tmp_path / "tensor.gguf"
    rewrite_gguf(demo_gguf, path, drop_tensors=("blk.1.attn_k.weight",))
    assert "missing tensor 'blk.1.attn_k.weight'" in logits_error(path, tmp_path, capsys)


def test_unsupported_quant_type(demo_gguf, tmp_path, capsys):
    """Q8_1: ggml's intermediate activation type, which no model file stores."""
    path = tmp_path / "q8_1.gguf"

    def to_q8_1(name, data, qtype):
        if name != "blk.0.attn_q.weight":
            return data, qtype
        rows, cols = 64, 64  # Q8_1: 32 values in 40 bytes
        return np.zeros((rows, cols // 32 * 40), dtype=np.uint8), GGMLQuantizationType.Q8_1

    rewrite_gguf(demo_gguf, path, edit_tensor=to_q8_1)
    line = logits_error(path, tmp_path, capsys)
    assert "'blk.0.attn_q.weight'" in line and "Q8_1" in line


def test_bad_token_ids(demo_gguf, tmp_path, capsys):
    code = main(["logits", str(demo_gguf), "--token-ids", "1,99999", "--out", str(tmp_path / "x.npy")])
    assert code == 2 and "--token-ids" in capsys.readouterr().err


# ---- tensor shapes against the hyper-parameters ------------------------------------------------


def cut_rows(target: str, rows: int):
    def edit(name, data, qtype):
        return (data[:rows], qtype) if name == target else (data, qtype)
    return edit


@pytest.mark.parametrize("tensor, rows, expected", [
    ("blk.0.attn_k.weight", 16, "[32, 64]"),           # head_count_kv * key_length rows
    ("output.weight", 1, "[275, 64]"),                 # one row: logits of shape [3, 1] before
    ("token_embd.weight", 274, "[275, 64]"),
    ("blk.1.ffn_gate_inp.weight", 7, "[8, 64]"),       # the router: one row per expert
    ("blk.0.attn_q_norm.weight", 8, "[16]"),           # per head: key_length
    ("blk.1.ffn_up_exps.weight", 7, "[8, 32, 64]"),    # [expert_count, expert_feed_forward_length, hidden]
])
def test_a_tensor_that_disagrees_with_the_hyper_parameters(demo_gguf, tmp_path, capsys, tensor, rows, expected):
    path = tmp_path / "shape.gguf"
    rewrite_gguf(demo_gguf, path, edit_tensor=cut_rows(tensor, rows))
    line = logits_error(path, tmp_path, capsys)
    assert f"shape.gguf: tensor '{tensor}' has shape [{rows}" in line and f"hyper-parameters give {expected}" in line


def test_a_renamed_output_does_not_pass_as_tied_embeddings(demo_gguf, tmp_path, capsys):
    path = tmp_path / "renamed.gguf"
    rewrite_gguf(demo_gguf, path, rename_tensors={"output.weight": "outputs.weight"})
    assert "tensor 'outputs.weight' is unknown to a qwen3moe model" in logits_error(path, tmp_path, capsys)


def test_layers_past_block_count_are_refused(demo_gguf, tmp_path, capsys):
    path = tmp_path / "layers.gguf"
    rewrite_gguf(demo_gguf, path, set_keys={"qwen3moe.block_count": 1})
    line = logits_error(path, tmp_path, capsys)
    assert "tensor 'blk.1." in line and "is past the last layer (qwen3moe.block_count = 1)" in line


def test_the_expert_side_checks_expert_shapes(demo_gguf, tmp_path):
    from splitmoe.modelfile.expert_tensors import ExpertShard

    path = tmp_path / "experts.gguf"
    rewrite_gguf(demo_gguf, path, set_keys={"qwen3moe.expert_feed_forward_length": 16})
    with pytest.raises(GGUFError, match=r"experts.gguf: tensor 'blk.0.ffn_gate_exps.weight' has shape "
                                        r"\[8, 32, 64\], but the hyper-parameters give \[8, 16, 64\]"):
        ExpertShard(GGUFFile(path))


@pytest.mark.skipif(not (FIXTURES / "deepseek2").is_dir(), reason="../shared/fixtures not found")
def test_mla_tensors_are_checked(tmp_path, capsys):
    path = tmp_path / "mla.gguf"
    rewrite_gguf(FIXTURES / "deepseek2" / "deepseek2-q8_0.gguf", path,
                 set_keys={"deepseek2.attention.value_length_mla": 8})
    line = logits_error(path, tmp_path, capsys)
    assert "tensor 'blk.0.attn_v_b.weight' has shape [4, 16, 32], but the hyper-parameters give [4, 8, 32]" in line


@pytest.mark.skipif(not (FIXTURES / "gptoss").is_dir(), reason="../shared/fixtures not found")
def test_attention_sinks_are_checked(tmp_path, capsys):
    path = tmp_path / "sinks.gguf"
    rewrite_gguf(FIXTURES / "gptoss" / "gptoss-q8_0.gguf", path, edit_tensor=cut_rows("blk.1.attn_sinks.weight", 3))
    assert "tensor 'blk.1.attn_sinks.weight' has shape [3], but the hyper-parameters give [4]" in \
        logits_error(path, tmp_path, capsys)


# ---- hyper-parameters refused before anything is allocated --------------------------------------


@pytest.mark.parametrize("key, value, message", [
    ("attention.head_count_kv", 2**31 - 1, "= 2147483647 is out of range: must lie in [1, 4]"),
    ("attention.head_count_kv", 3, "= 3 does not divide attention.head_count = 4"),
    ("block_count", 10**9, "= 1000000000 is out of range: must lie in [1, 1024]"),
    ("embedding_length", 0, "= 0 is out of range"),
    ("expert_used_count", 9, "= 9 is out of range: must lie in [1, 8]"),
    ("context_length", -1, "= -1 is out of range"),
    ("vocab_size", 2**30, "is out of range"),
    ("attention.layer_norm_rms_epsilon", float("nan"), "= nan must be positive and below 1 and finite"),
    ("rope.freq_base", -1.0, "= -1.0 must be positive"),
    ("rope.dimension_count", 15, "= 15 is not a multiple of 2"),
    ("block_count", 2.0, "is FLOAT32, expected an integer"),
    ("rope.freq_base", 10000, "is INT32, expected a float"),
])
def test_absurd_hyper_parameters(demo_gguf, tmp_path, capsys, key, value, message):
    path = tmp_path / "hparams.gguf"
    rewrite_gguf(demo_gguf, path, set_keys={f"qwen3moe.{key}": value})
    line = logits_error(path, tmp_path, capsys)
    assert f"hparams.gguf: metadata key 'qwen3moe.{key}'" in line and message in line


def test_a_derived_default_out_of_range_says_it_is_one(demo_gguf, tmp_path, capsys):
    path = tmp_path / "heads.gguf"
    rewrite_gguf(demo_gguf, path, drop_keys=("qwen3moe.attention.key_length",),
                 set_keys={"qwen3moe.attention.head_count": 128})
    line = logits_error(path, tmp_path, capsys)
    assert "'qwen3moe.attention.key_length' = 0 (absent from the file: its default) is out of range" in line


def test_yarn_without_its_original_context_is_refused(demo_gguf, tmp_path, capsys):
    path = tmp_path / "yarn.gguf"
    rewrite_gguf(demo_gguf, path, set_keys={"qwen3moe.rope.scaling.type": "yarn", "qwen3moe.rope.scaling.factor": 4.0})
    line = logits_error(path, tmp_path, capsys)
    assert "'qwen3moe.rope.scaling.original_context_length' = 0 (absent from the file: its default)" in line


# ---- the command line: one line, the exit code, the traceback only when asked -------------------


def test_an_internal_fault_is_one_line_and_exit_1(demo_gguf, tmp_path, capsys, monkeypatch):
    from splitmoe.commands import model

    def fault(args):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(model, "cmd_logits", fault)
    code = main(["logits", str(demo_gguf), "--token-ids", "1", "--out", str(tmp_path / "x.npy")])
    err = capsys.readouterr().err
    assert code == 1 and err.strip().splitlines() == [
        "splitmoe logits: error: internal error: RuntimeError: boom (SPLITMOE_LOG_LEVEL=DEBUG shows where)"]

    monkeypatch.setenv("SPLITMOE_LOG_LEVEL", "DEBUG")
    code = main(["logits", str(demo_gguf), "--token-ids", "1", "--out", str(tmp_path / "x.npy")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("Traceback") and "in fault" in err
    assert err.strip().splitlines()[-1].startswith("splitmoe logits: error: internal error: RuntimeError: boom")


def test_the_traceback_of_a_bad_file_only_with_debug(demo_gguf, tmp_path, capsys, monkeypatch):
    path = tmp_path / "tensor.gguf"
    rewrite_gguf(demo_gguf, path, drop_tensors=("blk.1.attn_k.weight",))
    monkeypatch.setenv("SPLITMOE_LOG_LEVEL", "debug")
    assert main(["logits", str(path), "--token-ids", "1", "--out", str(tmp_path / "x.npy")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "GGUFError" in err
    assert err.strip().splitlines()[-1] == "splitmoe logits: error: tensor.gguf: missing tensor 'blk.1.attn_k.weight'"


@pytest.mark.stack
def test_the_attention_service_exits_with_the_line_instead_of_serving(demo_gguf, tmp_path):
    """A wrong `attn_k` used to load, report SERVING, then fail every request with INTERNAL."""
    path = tmp_path / "attn_k.gguf"
    rewrite_gguf(demo_gguf, path, edit_tensor=cut_rows("blk.0.attn_k.weight", 16))
    proc = subprocess.run([sys.executable, "-m", "splitmoe", "serve-attention", str(path), "--port", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "splitmoe serve-attention: error: attn_k.gguf: tensor 'blk.0.attn_k.weight' has shape [16, 64], "
        "but the hyper-parameters give [32, 64]")


def test_weights_that_give_non_finite_logits_do_not_exit_0(demo_gguf, tmp_path, capsys):
    """GGUF has no checksum: a NaN weight loads. `logits` must still not hand NaN over as a result."""
    path = tmp_path / "nan.gguf"

    def nan_norm(name, data, qtype):
        return (np.full_like(data, np.nan), qtype) if name == "output_norm.weight" else (data, qtype)

    rewrite_gguf(demo_gguf, path, edit_tensor=nan_norm)
    line = logits_error(path, tmp_path, capsys)
    assert "nan.gguf: 825 of 825 logits are not finite" in line
    assert not (tmp_path / "x.npy").exists()


@pytest.mark.parametrize("key", ["dbrx.attention.clamp_kqv", "dbrx.attention.layer_norm_epsilon"])
def test_missing_key_llama_cpp_requires_of_dbrx(fixtures_dir, tmp_path, capsys, key):
    """Keys other architectures' files may omit: DBRX's without them are broken, as llama.cpp says too."""
    path = tmp_path / "dbrx.gguf"
    rewrite_gguf(fixtures_dir / "dbrx" / "dbrx-q8_0.gguf", path, drop_keys=(key,))
    assert logits_error(path, tmp_path, capsys) == f"splitmoe logits: error: dbrx.gguf: missing metadata key '{key}'"


def test_fused_qkv_of_the_wrong_height(fixtures_dir, tmp_path, capsys):
    """attn_qkv must hold q, k and v of the heads the metadata states."""
    path = tmp_path / "dbrx.gguf"
    rewrite_gguf(fixtures_dir / "dbrx" / "dbrx-q8_0.gguf", path, set_keys={"dbrx.attention.head_count_kv": 4})
    line = logits_error(path, tmp_path, capsys)
    assert "dbrx.gguf" in line and "'blk.0.attn_qkv.weight'" in line


def test_negative_clamp_kqv(fixtures_dir, tmp_path, capsys):
    path = tmp_path / "dbrx.gguf"
    rewrite_gguf(fixtures_dir / "dbrx" / "dbrx-q8_0.gguf", path, set_keys={"dbrx.attention.clamp_kqv": -2.0})
    assert logits_error(path, tmp_path, capsys) == (
        "splitmoe logits: error: dbrx.gguf: metadata key 'dbrx.attention.clamp_kqv' = -2.0 must be >= 0 and finite")
