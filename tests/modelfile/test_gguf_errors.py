"""Broken or unsupported GGUF files fail with one clear line naming the key or tensor."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from splitmoe.cli import main
from tests.support.gguf_edit import rewrite_gguf


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
    path = tmp_path / "iq.gguf"

    def to_iq4_nl(name, data, qtype):
        if name != "blk.0.attn_q.weight":
            return data, qtype
        rows, cols = 64, 64  # IQ4_NL: 32 values in 18 bytes
        return np.zeros((rows, cols // 32 * 18), dtype=np.uint8), GGMLQuantizationType.IQ4_NL

    rewrite_gguf(demo_gguf, path, edit_tensor=to_iq4_nl)
    line = logits_error(path, tmp_path, capsys)
    assert "'blk.0.attn_q.weight'" in line and "IQ4_NL" in line


def test_bad_token_ids(demo_gguf, tmp_path, capsys):
    code = main(["logits", str(demo_gguf), "--token-ids", "1,99999", "--out", str(tmp_path / "x.npy")])
    assert code == 2 and "--token-ids" in capsys.readouterr().err
