"""llama.cpp-converted fixtures against transformers and llama.cpp references (see fixtures README)."""
import json

import numpy as np
import pytest

from splitmoe.cli import main
from tests.support.cpu_paths import PATHS, forced_path

ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "dbrx", "deepseek", "glm4moe", "llama4"]
QUANTS = ["q8_0", "q4_k_m"]
# The exact-dequant reference of each quantized file: transformers on its dequantized weights, or
# for deepseek (no transformers class) llama.cpp on an all-F32 copy of it.
EXACT = {"deepseek": "llamacpp_deq"}
EXACT_F32 = {"deepseek": "llamacpp_f32"}  # and of its original weights
# The families held to the per-position bound of issue 16. Of the older ones, qwen3moe's q8_0 file
# has 2 such positions in bfloat16 where llama.cpp has 1; they keep the aggregate bound.
PER_POSITION_ARCHS = ["dbrx", "deepseek", "glm4moe", "llama4"]
# GLM-4.5's routed scale 2.5 amplifies routing near-ties (llama.cpp's own q8_0 run flips one of 78
# positions): its whole-prompt rel-L2 is not a bound to hold, the per-position one is.
AGGREGATE_ARCHS = [a for a in ARCHS if a != "glm4moe"]
# Per-position rel-L2 above which a position moved as a flipped routing choice moves it.
FLIPPED = 5e-2


def exact_reference(arch, quant):
    return f"{EXACT.get(arch, 'hfdeq')}_{quant}"


def prompts(fixtures_dir):
    return json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]


def run_logits(tmp_path, model, ids, dtype="float32"):
    out = tmp_path / "logits.npy"
    assert main(["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--dtype", dtype]) == 0
    return np.load(out)


def rel_l2(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def each_prompt(fixtures_dir, tmp_path, model, ref_name, dtype="float32", arch_dir=None):
    arch_dir = arch_dir or model.parent
    for i, p in enumerate(prompts(fixtures_dir)):
        got = run_logits(tmp_path, model, p["ids"], dtype)
        ref = np.load(arch_dir / "ref" / f"{ref_name}_p{i}.npy")
        assert got.shape == ref.shape == (p["n_tokens"], 2048)
        yield got, ref


def test_qwen3moe_f32_matches_transformers(fixtures_dir, tmp_path):
    model = fixtures_dir / "qwen3moe" / "qwen3moe-f32.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, "hf_float32"):
        assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_conversion_matches_the_checkpoint_reference(fixtures_dir, tmp_path, arch):
    """Only qwen3moe ships an f32 GGUF: the others' checkpoints converted here to F32 (by the
    test converter, which test_hf_to_gguf_layout holds to llama.cpp's bytes) must give the
    references of the original weights, `hf_float32` (deepseek: llama.cpp's `llamacpp_f32`)."""
    from tests.support.hf_to_gguf import F32, convert, load_checkpoint

    arch_dir = fixtures_dir / arch
    model = convert(load_checkpoint(arch_dir / "hf"), tmp_path / f"{arch}-f32.gguf", F32,
                    tokenizer_from=arch_dir / f"{arch}-q8_0.gguf")
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, EXACT_F32.get(arch, "hf_float32"), arch_dir=arch_dir):
        assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_float32_matches_dequantized_transformers(fixtures_dir, tmp_path, arch, quant):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, exact_reference(arch, quant)):
        assert np.abs(got - ref).max() <= 1e-4


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", AGGREGATE_ARCHS)
def test_bfloat16_close_to_dequantized_transformers(fixtures_dir, tmp_path, arch, quant, path):
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    with forced_path(path):
        for got, ref in each_prompt(fixtures_dir, tmp_path, model, exact_reference(arch, quant), dtype="bfloat16"):
            assert rel_l2(got, ref) <= 3e-2


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", PER_POSITION_ARCHS)
def test_bfloat16_per_position_no_more_flips_than_llamacpp(fixtures_dir, tmp_path, arch, quant, path):
    """Against the exact-dequant reference, per position over both prompts: the median within
    2e-2 (llama.cpp's own quantized run sits at 0.8-1.9e-2), and no more positions moved as a
    routing flip moves them than llama.cpp's run has."""
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    with forced_path(path):
        ours = np.concatenate([per_position_rel_l2(got, ref) for got, ref in each_prompt(
            fixtures_dir, tmp_path, model, exact_reference(arch, quant), dtype="bfloat16")])
    llamacpp = np.concatenate([per_position_rel_l2(np.load(model.parent / "ref" / f"llamacpp_{quant}_p{i}.npy"), ref)
                               for i, ref in enumerate(references(model.parent, exact_reference(arch, quant)))])
    assert np.median(ours) <= 2e-2
    assert (ours > FLIPPED).sum() <= (llamacpp > FLIPPED).sum()


def per_position_rel_l2(x, ref):
    return np.linalg.norm(x - ref, axis=1) / np.linalg.norm(ref, axis=1)


def references(arch_dir, name):
    return [np.load(arch_dir / "ref" / f"{name}_p{i}.npy") for i in range(2)]


def test_qwen3moe_f32_bfloat16_close_to_transformers(fixtures_dir, tmp_path):
    model = fixtures_dir / "qwen3moe" / "qwen3moe-f32.gguf"
    for got, ref in each_prompt(fixtures_dir, tmp_path, model, "hf_float32", dtype="bfloat16"):
        assert rel_l2(got, ref) <= 3e-2


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_within_llamacpp_distance(fixtures_dir, tmp_path, arch, quant):
    """llama.cpp quantizes activations too, so compare per position, as the fixtures README says,
    over both prompts' 78 positions (on p0 alone, llama.cpp's dbrx q8_0 agrees with the exact
    reference on 21 of 25 top-1 tokens: these logits are flat)."""
    model = fixtures_dir / arch / f"{arch}-{quant}.gguf"
    got, ref = (np.concatenate(a) for a in zip(*each_prompt(fixtures_dir, tmp_path, model, f"llamacpp_{quant}")))
    assert np.median(per_position_rel_l2(got, ref)) < 5e-2
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.85
