"""`splitmoe bench make-model`: real shapes (1-2 layers, small vocab) that load, run, and hold the
quant mix and weight statistics intended; the same seed gives the same bytes. gpt-oss-120b and
DeepSeek-V3 files keep their real widths but fewer experts (one layer of all of them is 1.7 GB and
2.9 GB), and have the tensor names, ranks and metadata keys llama.cpp's converter writes (its
fixtures of the two architectures)."""
import dataclasses
import filecmp
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from splitmoe.attention_service.gpu.vram import SHAPES as REAL_CONFIGS
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.bench.make_model import (
    QUANTS,
    SHAPES,
    TensorSpec,
    bench_shape,
    make_tensor,
    plan,
    use_more_bits,
    write_model,
)
from splitmoe.cli import main
from splitmoe.kernels.quants import QuantTensor, dequantize
from splitmoe.modelfile.architectures import architecture
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.tokenizer import Tokenizer

VOCAB = 1024
FIXTURES = Path("/work/shared/fixtures")
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


def _types(g: GGUFFile) -> dict[str, T]:
    return {n: T(g.tensor(n).ggml_type) for n in g.tensor_names}


def _run_one_step(g: GGUFFile, dtype: torch.dtype = torch.float32) -> ModelRunner:
    tok = Tokenizer.from_gguf_metadata(g.metadata)
    assert tok.decode(tok.encode("hello there, world")) == "hello there, world"
    ids = tok.encode("the")  # few tokens: the CPU experts they route to dominate the test's time
    runner = ModelRunner.from_gguf(g, RunnerOptions(device=torch.device("cpu"), kv_cache_tokens=64, dtype=dtype))
    logits = runner.step([Sequence(0, ids)])
    assert logits.shape == (1, VOCAB) and torch.isfinite(logits).all()
    return runner


def _std(g: GGUFFile, name: str, expert: int | None = None, rows: int = 256) -> float:
    """Of the tensor's (or one expert's) first `rows` rows: enough values, and seconds for 18432x7168."""
    qt = g.tensor(name)
    qt = qt if expert is None else qt[expert]
    head = QuantTensor(qt.name, qt.ggml_type, (min(rows, qt.shape[0]), *qt.shape[1:]), qt.data[:rows])
    return dequantize(head).std().item()


def _config_differences(got, want) -> list[str]:
    """Fields of two ModelConfigs that differ; floats within float32's rounding of the file's keys."""
    out = []
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if dataclasses.is_dataclass(b) and a is not None:
            out += [f"{f.name}.{d}" for d in _config_differences(a, b)]
        elif not (a == pytest.approx(b, rel=1e-6) if isinstance(b, float) else a == b):
            out.append(f"{f.name}: {a!r} != {b!r}")
    return out


def _arch_keys(g: GGUFFile) -> set[str]:
    return {k for k in g.metadata if k.startswith(g.arch + ".")}


@pytest.mark.parametrize("quant", ["q4_k_m", "q4_0", "q8_0"])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "olmoe-1b-7b"])
def test_one_layer_model_loads_runs_and_has_the_intended_weights(tmp_path, shape, quant):
    path = write_model(tmp_path / "m.gguf", shape, layers=1, quant=quant, seed=1, vocab=VOCAB)
    g = GGUFFile(path)
    s = SHAPES[shape]
    assert g.arch == s.arch and g.arch_get("expert_count") == s.experts
    experts = g.tensor("blk.0.ffn_down_exps.weight")
    assert experts.shape == (s.experts, s.hidden, s.expert_ffn)

    types = {_short(n): t for n, t in _types(g).items()}
    assert {k: types[k] for k in EXPECTED[quant]} == EXPECTED[quant]
    assert all(types[k] == T.F32 for k in F32)

    for name, want in [("token_embd.weight", 1.0), ("blk.0.attn_v.weight", s.hidden ** -0.5),
                       ("blk.0.attn_output.weight", (s.heads * s.head_dim) ** -0.5),
                       ("output.weight", s.hidden ** -0.5)]:
        assert _std(g, name) == pytest.approx(want, rel=0.2), name
    for name, fan_in in [("ffn_gate_exps", s.hidden), ("ffn_down_exps", s.expert_ffn)]:
        assert _std(g, f"blk.0.{name}.weight", expert=3) == pytest.approx(fan_in ** -0.5, rel=0.2), name
    _run_one_step(g)


def test_gpt_oss_120b_is_what_llama_quantize_mxfp4_moe_writes_and_runs(tmp_path):
    """Two layers (one sliding, one full) of 8 of the 128 experts: the fixture's tensors, types
    (llama-quantize MXFP4_MOE) and keys, the real config's hyper-parameters, one step."""
    path = write_model(tmp_path / "m.gguf", "gpt-oss-120b", layers=2, quant="mxfp4_moe", seed=1, vocab=VOCAB,
                       experts=8)
    g, fixture = GGUFFile(path), GGUFFile(FIXTURES / "gptoss/gptoss-mxfp4_moe.gguf")
    assert _types(g) == _types(fixture)  # every name and type, F32 biases, sinks and router included
    assert _arch_keys(fixture) <= _arch_keys(g)

    want = dataclasses.replace(REAL_CONFIGS["gpt-oss-120b"].cfg, num_layers=2, vocab_size=VOCAB, num_experts=8)
    # sliding window 128, YaRN x32 over 4096, theta 150000, ...
    assert _config_differences(architecture(g.arch).config(g), want) == []
    assert g.tensor("blk.1.ffn_up_exps.weight").shape == (8, 2880, 2880)

    for name, fan_in in [("blk.0.ffn_gate_exps.weight", 2880), ("blk.1.ffn_down_exps.weight", 2880)]:
        assert _std(g, name, expert=5) == pytest.approx(fan_in ** -0.5, rel=0.1), name
    for name, fan_in in [("blk.0.attn_q.weight", 2880), ("blk.1.attn_output.weight", 64 * 64)]:
        assert _std(g, name) == pytest.approx(fan_in ** -0.5, rel=0.1), name
    _run_one_step(g, torch.bfloat16)


def test_deepseek_v3_has_the_converters_tensors_and_keys():
    """3 layers with one dense, as the deepseek3 fixture (first_k_dense_replace 1): the same tensor
    names and ranks, MLA in the attn_k_b / attn_v_b layout."""
    fixture = GGUFFile(FIXTURES / "deepseek3/deepseek3-q4_k_m.gguf")
    specs = plan(bench_shape("deepseek-v3"), 3, "q4_k_m")
    assert {t.name: len(t.shape) for t in specs} == {n: len(fixture.tensor(n).shape) for n in fixture.tensor_names}


def test_deepseek_v3_ud_iq1_s_loads_runs_and_has_the_intended_weights(tmp_path):
    """Two layers, the first dense, 16 of the 256 experts (8 groups of 2, top-4 groups): the real
    config's hyper-parameters, Unsloth-style types, the std asked for, one step."""
    path = write_model(tmp_path / "m.gguf", "deepseek-v3", layers=2, quant="ud_iq1_s", seed=1, vocab=VOCAB,
                       experts=16)
    g = GGUFFile(path)
    fixture = GGUFFile(FIXTURES / "deepseek3/deepseek3-q4_k_m.gguf")
    assert _arch_keys(fixture) <= _arch_keys(g)
    want = dataclasses.replace(REAL_CONFIGS["deepseek-v3"].cfg, num_layers=2, vocab_size=VOCAB, num_experts=16,
                               num_leading_dense_layers=1)
    # MLA dims, groups, sigmoid, scale 2.5, YaRN x40 with its mscale, ...
    assert _config_differences(architecture(g.arch).config(g), want) == []

    types = _types(g)
    assert {n: types[n] for n in ("token_embd.weight", "output.weight", "blk.0.ffn_gate.weight",
                                  "blk.0.ffn_down.weight", "blk.1.attn_q_b.weight", "blk.1.attn_kv_a_mqa.weight",
                                  "blk.1.attn_k_b.weight", "blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight",
                                  "blk.1.ffn_down_exps.weight", "blk.1.ffn_down_shexp.weight",
                                  "blk.1.exp_probs_b.bias")} == {
        "token_embd.weight": T.Q4_K, "output.weight": T.Q6_K, "blk.0.ffn_gate.weight": T.Q4_K,
        "blk.0.ffn_down.weight": T.Q6_K, "blk.1.attn_q_b.weight": T.Q4_K, "blk.1.attn_kv_a_mqa.weight": T.Q6_K,
        "blk.1.attn_k_b.weight": T.Q8_0,  # rows of 128: Q6_K falls back, as llama-quantize does
        "blk.1.ffn_gate_exps.weight": T.IQ1_S, "blk.1.ffn_up_exps.weight": T.IQ1_S,
        "blk.1.ffn_down_exps.weight": T.IQ3_XXS, "blk.1.ffn_down_shexp.weight": T.Q6_K, "blk.1.exp_probs_b.bias": T.F32}

    for name, fan_in, expert in [("blk.1.ffn_gate_exps.weight", 7168, 9), ("blk.1.ffn_down_exps.weight", 2048, 9),
                                 ("blk.1.attn_q_b.weight", 1536, None), ("blk.1.attn_k_b.weight", 512, None),
                                 ("blk.0.ffn_down.weight", 18432, None)]:
        assert _std(g, name, expert) == pytest.approx(fan_in ** -0.5, rel=0.1), name
    runner = _run_one_step(g, torch.bfloat16)
    layers = runner.model.weights.layers
    assert layers[0].dense_ffn is not None and layers[0].moe is None
    assert layers[1].moe is not None and layers[1].moe.selection_bias is not None


def test_ud_iq1_s_mix_over_a_deeper_file():
    """The down_proj ladder: IQ3_XXS on the first MoE layer, IQ2_XXS up to an eighth of the real
    model's 61 layers, IQ1_S after; gate/up IQ1_S everywhere; the dense layer 4/6-bit."""
    specs = {t.name: t.ggml_type for t in plan(bench_shape("deepseek-v3"), 9, "ud_iq1_s", vocab=VOCAB)}
    down = [specs[f"blk.{i}.ffn_down_exps.weight"] for i in range(1, 9)]
    assert down == [T.IQ3_XXS] + [T.IQ2_XXS] * 5 + [T.IQ1_S] * 2
    assert {specs[f"blk.{i}.ffn_{m}_exps.weight"] for i in range(1, 9) for m in ("gate", "up")} == {T.IQ1_S}
    assert "blk.0.ffn_gate_inp.weight" not in specs and "blk.1.ffn_gate.weight" not in specs
    assert (specs["blk.0.ffn_gate.weight"], specs["blk.0.ffn_up.weight"], specs["blk.0.ffn_down.weight"]) == (
        T.Q4_K, T.Q4_K, T.Q6_K)
    assert {specs[f"blk.4.{n}.weight"] for n in ("attn_q_a", "attn_q_b")} == {T.Q4_K}
    assert {specs[f"blk.4.{n}.weight"] for n in ("attn_kv_a_mqa", "attn_v_b", "attn_output", "ffn_gate_shexp",
                                                  "ffn_up_shexp", "ffn_down_shexp")} == {T.Q6_K}


def test_dense_layers_and_experts_overrides():
    assert bench_shape("deepseek-v3").leading_dense == 1
    three = plan(bench_shape("deepseek-v3", dense_layers=3), 4, "ud_iq1_s", vocab=VOCAB)
    assert [i for i in range(4) if any(t.name == f"blk.{i}.ffn_gate.weight" for t in three)] == [0, 1, 2]
    assert bench_shape("deepseek-v3", dense_layers=0).leading_dense == 0
    with pytest.raises(ValueError, match="no dense layers"):
        bench_shape("qwen3-30b-a3b", dense_layers=1)
    with pytest.raises(ValueError, match="groups"):
        bench_shape("deepseek-v3", experts=12)  # not a multiple of 8 groups
    with pytest.raises(ValueError, match="groups"):
        bench_shape("deepseek-v3", experts=8)  # 4 groups of 1 leave 4 experts for a top-8
    assert bench_shape("gpt-oss-120b", experts=4).experts == 4


@pytest.mark.parametrize("args", [["--shape", "olmoe-1b-7b", "--quant", "q4_0"],
                                  ["--shape", "gpt-oss-120b", "--quant", "mxfp4_moe", "--experts", "4"]])
def test_same_seed_same_bytes_through_the_cli(tmp_path, args):
    args = ["bench", "make-model", *args, "--layers", "1", "--vocab", str(VOCAB), "--seed", "7"]
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    assert main([*args, "--out", str(a)]) == 0
    assert main([*args, "--out", str(b)]) == 0
    assert filecmp.cmp(a, b, shallow=False)


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q5_0, T.Q8_0, T.IQ4_NL, T.Q4_K, T.Q6_K, T.MXFP4, T.IQ1_S, T.IQ2_XXS,
                                       T.IQ3_XXS])
@pytest.mark.parametrize("fan_in", [1024, 7168])
def test_random_blocks_have_the_asked_std_and_no_bias(ggml_type, fan_in):
    """Checked through SplitMoE's own dequantizer; two fan-ins put MXFP4's power-of-two scales
    at different places between two exponents."""
    spec = TensorSpec("x", (256, fan_in), ggml_type, fan_in ** -0.5)
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


def test_q4_k_m_falls_back_where_llama_quantize_does():
    """gpt-oss's 2880-wide rows hold no 256-element blocks: Q4_K becomes Q5_0, Q6_K Q8_0, as in the
    gpt-oss q4_k_m fixture; DeepSeek's attn_v_b is not attn_v (no Q6_K), its attn_k_b rows of 128 fall back."""
    specs = {t.name: t.ggml_type for t in plan(bench_shape("gpt-oss-120b"), 3, "q4_k_m", vocab=VOCAB)}
    assert (specs["blk.0.ffn_gate_exps.weight"], specs["blk.2.ffn_down_exps.weight"], specs["output.weight"]) == (
        T.Q5_0, T.Q8_0, T.Q8_0)
    assert specs["blk.0.attn_output.weight"] == T.Q4_K  # 4096-wide rows fit
    ds = {t.name: t.ggml_type for t in plan(bench_shape("deepseek-v3"), 3, "q4_k_m", vocab=VOCAB)}
    assert (ds["blk.2.attn_v_b.weight"], ds["blk.2.attn_k_b.weight"], ds["blk.2.ffn_down_exps.weight"]) == (
        T.Q4_K, T.Q5_0, T.Q6_K)


@pytest.mark.parametrize("quant", list(QUANTS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_splits_into_whole_quant_blocks(shape, quant):
    """Every shape and mix, the large ones that no test writes too: each quantized row is whole
    blocks of its type (TensorSpec.nbytes would otherwise drop a remainder) and heads group."""
    s = bench_shape(shape)
    assert s.heads % s.kv_heads == 0 and s.experts_used <= s.experts
    for t in plan(s, 3, quant, vocab=VOCAB):
        if t.ggml_type != T.F32:
            assert t.shape[-1] % GGML_QUANT_SIZES[t.ggml_type][0] == 0, t.name
