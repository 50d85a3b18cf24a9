"""llama.cpp-converted fixtures against transformers and llama.cpp references (see fixtures README)."""
import json

import numpy as np
import pytest

from splitmoe.cli import main
from tests.support.cpu_paths import PATHS, forced_path

ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe"]
QUANTS = ["q8_0", "q4_k_m"]


def prompts(fixtures_dir):
    return json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]


def run_logits(tmp_path, model, ids, dtype="float32"):
    out = tmp_path / "logits.npy"
    assert main(["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--dtype", dtype]) == 0
    return np.load(out)


def rel_l2(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def each_prompt(fixtures_dir, tmp_path, model, ref_name, dtype="float32"):
    arch_dir = model.parent
    for i, p in enumerate(prompts(fixtures_dir)):
        got = run_logits(tmp_path, model, p["ids"], dtype)
        ref = np.load(arch_dir / "ref" / f"{ref_name}_p{i}.npy")
        assert got.shape == ref.shape == (p["n_tokens"], 2048)
        yield got, ref


def test_qwen3moe_f32_matches_transformers(fixtures_dir, tmp_path):
    model = fixtures_dir / "qwen3moe" / "qwen3moe-f32.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, "hf_float32"):
        assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_float32_matches_dequantized_transformers(fixtures_dir, tmp_path, arch, quant):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, f"hfdeq_{quant}"):
        assert np.abs(got - ref).max() <= 1e-3


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_close_to_dequantized_transformers(fixtures_dir, tmp_path, arch, quant, path):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    with forced_path(path):
        for got, ref in each_prompt(fixtures_dir, tmp_path, model, f"hfdeq_{quant}", dtype="bfloat16"):
            assert rel_l2(got, ref) <= 3e-2


def test_qwen3moe_f32_bfloat16_close_to_transformers(fixtures_dir, tmp_path):
    model = fixtures_dir / "qwen3moe" / "qwen3moe-f32.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, "hf_float32", dtype="bfloat16"):
        assert rel_l2(got, ref) <= 3e-2


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_within_llamacpp_distance(fixtures_dir, tmp_path, arch, quant):
    """llama.cpp quantizes activations too, so compare per position, as the fixtures README says."""
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, f"llamacpp_{quant}"):
        per_position = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        assert np.median(per_position) < 5e-2
        assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.85
