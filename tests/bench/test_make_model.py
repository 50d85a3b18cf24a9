"""`splitmoe bench make-model`: real shapes (1 layer, small vocab) that load, run, and hold the
quant mix and weight statistics intended; the same seed gives the same bytes."""
import filecmp

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.bench.make_model import SHAPES, TensorSpec, make_tensor, plan, use_more_bits, write_model
from splitmoe.cli import main
from splitmoe.kernels.quants import QuantTensor, dequantize
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.tokenizer import Tokenizer

VOCAB = 1024
# 1-layer files: use_more_bits(0, 1) holds, so Q4_K_M's ffn_down/attn_v are Q6_K.
EXPECTED = {
    "q4_k_m": {"token_embd": T.Q4_K, "attn_q": T.Q4_K, "attn_v": T.Q6_K, "attn_output": T.Q4_K,
               "ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K, "ffn_down_exps": T.Q6_K, "output": T.Q6_K},
    "q4_0": {"token_embd": T.Q4_0, "attn_v": T.Q4_0, "ffn_down_exps": T.Q4_0, "output": T.Q4_0},
    "q8_0": {"token_embd": T.Q8_0, "attn_v": T.Q8_0, "ffn_down_exps": T.Q8_0, "output": T.Q8_0},
}
F32 = ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm", "ffn_gate_inp", "output_norm")


def _short(name: str) -> str:
    return name.removeprefix("blk.0.").removesuffix(".weight")


@pytest.mark.parametrize("quant", ["q4_k_m", "q4_0", "q8_0"])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "olmoe-1b-7b"])
def test_one_layer_model_loads_runs_and_has_the_intended_weights(tmp_path, shape, quant):
    path = write_model(tmp_path / "m.gguf", shape, layers=1, quant=quant, seed=1, vocab=VOCAB)
    g = GGUFFile(path)
    s = SHAPES[shape]
    assert g.arch == s.arch and g.arch_get("expert_count") == s.experts
    experts = g.tensor("blk.0.ffn_down_exps.weight")
    assert experts.shape == (s.experts, s.hidden, s.expert_ffn)

    types = {_short(n): T(g.tensor(n).ggml_type) for n in g.tensor_names}
    assert {k: types[k] for k in EXPECTED[quant]} == EXPECTED[quant]
    assert all(types[k] == T.F32 for k in F32)

    for name, want in [("token_embd.weight", 1.0), ("blk.0.attn_v.weight", s.hidden ** -0.5),
                       ("blk.0.attn_output.weight", (s.heads * s.head_dim) ** -0.5),
                       ("output.weight", s.hidden ** -0.5)]:
        assert dequantize(g.tensor(name)).std().item() == pytest.approx(want, rel=0.2), name
    for name, fan_in in [("ffn_gate_exps", s.hidden), ("ffn_down_exps", s.expert_ffn)]:
        one_expert = g.tensor(f"blk.0.{name}.weight")[3]
        assert dequantize(one_expert).std().item() == pytest.approx(fan_in ** -0.5, rel=0.2), name

    tok = Tokenizer.from_gguf_metadata(g.metadata)
    assert tok.decode(tok.encode("hello there, world")) == "hello there, world"
    ids = tok.encode("the")  # few tokens: the CPU experts they route to dominate the test's time
    runner = ModelRunner.from_gguf(g, RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=64))
    logits = runner.step([Sequence(0, ids)])
    assert logits.shape == (1, VOCAB) and torch.isfinite(logits).all()


def test_same_seed_same_bytes_through_the_cli(tmp_path):
    args = ["bench", "make-model", "--shape", "olmoe-1b-7b", "--layers", "1", "--quant", "q4_0",
            "--vocab", str(VOCAB), "--seed", "7"]
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main([*args, "--out", str(a)]) == 0
    assert main([*args, "--out", str(b)]) == 0
    assert filecmp.cmp(a, b, shallow=False)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q8_0, T.Q4_K, T.Q6_K])
def test_random_blocks_have_the_asked_std_and_no_bias(ggml_type):
    spec = TensorSpec("x", (512, 1024), ggml_type, 1024 ** -0.5)
    data = make_tensor(spec, seed=3)
    assert np.array_equal(data, make_tensor(spec, seed=3))
    assert not np.array_equal(data, make_tensor(spec, seed=4))
    x = dequantize(QuantTensor("x", int(ggml_type), spec.shape, data))
    assert x.std().item() == pytest.approx(spec.std, rel=0.02)
    assert abs(x.mean().item()) < 0.02 * spec.std


def test_q4_k_m_mix_follows_llama_quant_use_more_bits():
    # 48 layers as Qwen3-30B-A3B: the first and last 6 and every third one between get Q6_K.
    q6 = [i for i in range(48) if use_more_bits(i, 48)]
    assert q6 == [0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41, 42, 43, 44, 45, 46, 47]
    specs = {t.name: t.ggml_type for t in plan(SHAPES["qwen3-30b-a3b"], 6, "q4_k_m")}
    down = [i for i in range(6) if specs[f"blk.{i}.ffn_down_exps.weight"] == T.Q6_K]
    v = [i for i in range(6) if specs[f"blk.{i}.attn_v.weight"] == T.Q6_K]
    assert down == v == [2, 5]
    assert specs["blk.3.ffn_gate_exps.weight"] == specs["blk.3.attn_q.weight"] == T.Q4_K


@pytest.mark.parametrize("quant", ["q4_k_m", "q4_0", "q8_0"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_splits_into_whole_quant_blocks(shape, quant):
    """Every shape, the large ones (qwen3-235b-a22b) that no test writes too: each quantized row is
    whole blocks of its type (TensorSpec.nbytes would otherwise drop a remainder) and heads group."""
    s = SHAPES[shape]
    assert s.heads % s.kv_heads == 0 and s.experts_used <= s.experts
    for t in plan(s, 2, quant, vocab=VOCAB):
        if t.ggml_type != T.F32:
            assert t.shape[-1] % GGML_QUANT_SIZES[t.ggml_type][0] == 0, t.name
