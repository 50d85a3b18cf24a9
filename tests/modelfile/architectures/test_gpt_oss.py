"""gpt-oss: llama.cpp's fixture files against transformers and llama.cpp, and a model of our own.

The fixtures (../shared/fixtures/gptoss, see its README) are gpt-oss GGUFs in Q8_0, Q4_K_M
(mostly Q5_0 at these sizes) and MXFP4_MOE, with 2 layers (sliding, full), window 32; prompt p1
has 53 tokens, so its positions 32-52 exercise the window. `hfdeq_<q>` is transformers on the
exactly dequantized weights with YaRN `truncate: true`, which is what the GGUF implies.

The tiny transformers model runs everywhere: sliding window shorter than the sequence, sinks
N(0, 1), expert weights large enough that the clamped SwiGLU's limits are reached.
"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from splitmoe.attention_service.model import transformer
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.cli import main
from splitmoe.kernels.moe import SWIGLU_OAI_LIMIT
from tests.support.cpu_paths import PATHS, forced_path
from tests.support.hf_reference import NEAR_TIE, build_model, hf_logits, max_abs, rel_l2, routing_flips
from tests.support.hf_to_gguf import Q8_0, convert

QUANTS = ["q8_0", "q4_k_m", "mxfp4_moe"]
# (dtype, forced CPU path) of each run: bfloat16 on this CPU's best path and on the lower one.
RUNS = [("float32", "best"), *(("bfloat16", path) for path in PATHS)]


# ---- the llama.cpp fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(fixtures_dir) -> list[list[int]]:
    return [p["ids"] for p in json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]]


@pytest.fixture(scope="module")
def runs(fixtures_dir, prompt_ids, tmp_path_factory) -> dict:
    """(quant, dtype, path) -> per prompt (router logits and ids per layer, `splitmoe logits` output)."""
    out_dir = tmp_path_factory.mktemp("gptoss")
    runs = {}
    for q in QUANTS:
        for dtype, path in RUNS:
            with forced_path(path):
                runs[q, dtype, path] = [logits_with_routes(fixtures_dir / "gptoss" / f"gptoss-{q}.gguf", ids, dtype,
                                                           out_dir) for ids in prompt_ids]
    return runs


def logits_with_routes(model, ids: list[int], dtype: str, out_dir):
    routes = []

    def recording_route(router_logits, top_k, *args, **kwargs):
        chosen, weights = real_route(router_logits, top_k, *args, **kwargs)
        routes.append((router_logits.float().cpu(), chosen.cpu()))
        return chosen, weights

    real_route = transformer.route
    out = out_dir / "logits.npy"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformer, "route", recording_route)
        args = ["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--dtype", dtype]
        assert main(args) == 0
    return routes, np.load(out)


def reference(fixtures_dir, name: str, prompt: int) -> np.ndarray:
    return np.load(fixtures_dir / "gptoss" / "ref" / f"{name}_p{prompt}.npy")


@pytest.mark.parametrize("quant", QUANTS)
def test_float32_matches_dequantized_transformers(fixtures_dir, runs, quant):
    for i, (_, got) in enumerate(runs[quant, "float32", "best"]):
        ref = reference(fixtures_dir, f"hfdeq_{quant}", i)
        assert got.shape == ref.shape
        assert max_abs(got, ref) <= 1e-3


@pytest.mark.parametrize("quant", QUANTS)
def test_float32_within_llamacpp_distance(fixtures_dir, runs, quant):
    """llama.cpp also quantizes activations: compare per position (fixtures README)."""
    for i, (_, got) in enumerate(runs[quant, "float32", "best"]):
        ref = reference(fixtures_dir, f"llamacpp_{quant}", i)
        per_position = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
        assert np.median(per_position) < 5e-2
        assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.85


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quant", QUANTS)
def test_bfloat16_close_to_dequantized_transformers(fixtures_dir, runs, quant, path):
    """rel-L2 <= 3e-2 at every position whose experts bf16 did not change.

    gpt-oss's router logits here are flat: on p1, bf16 weights flip 3-4 expert choices whose
    float32 top-k boundary gap is < 0.013, and each moves its position by 10-20 % (whole-prompt
    rel-L2 3.3-4.1e-2; 1.1-1.2e-2 without those positions). Each flip must be such a near-tie,
    so a real routing bug still fails.
    """
    pairs = zip(runs[quant, "float32", "best"], runs[quant, "bfloat16", path])
    for i, ((f32_routes, _), (bf16_routes, got)) in enumerate(pairs):
        ref = reference(fixtures_dir, f"hfdeq_{quant}", i)
        flipped = routing_flips(f32_routes, bf16_routes)
        for position, (layer, gap) in flipped.items():
            assert gap < NEAR_TIE, f"p{i} position {position}, layer {layer}: bf16 changed a clear choice"
        kept = [t for t in range(len(ref)) if t not in flipped]
        assert len(kept) >= 0.9 * len(ref), f"p{i}: routing flipped at positions {sorted(flipped)}"
        assert rel_l2(got[kept], ref[kept]) <= 3e-2


def test_decode_token_by_token_equals_prefill(fixtures_dir, prompt_ids):
    """Through the paged cache (4-token blocks), past the 32-token window of layer 0."""
    options = RunnerOptions(kv_cache_tokens=256, kv_block_tokens=4, device=torch.device("cpu"))
    runner = ModelRunner.from_gguf(fixtures_dir / "gptoss" / "gptoss-q8_0.gguf", options)
    ids = prompt_ids[1]
    prefill = runner.step([Sequence(0, ids)], all_logits=True)
    seq = Sequence(1, ids)
    decoded = torch.cat([runner.step([seq], [1]) for _ in ids])
    chunked = Sequence(2, ids)
    in_chunks = torch.cat([runner.step([chunked], [n], all_logits=True) for n in (20, 33)])
    assert torch.abs(decoded - prefill).max().item() <= 1e-4
    assert torch.abs(in_chunks - prefill).max().item() <= 1e-4


def test_converter_writes_what_llama_cpp_wrote(fixtures_dir, tmp_path):
    """tests/support/hf_to_gguf.py on the fixture checkpoint: llama.cpp's names, types, bytes, metadata."""
    from transformers import AutoModelForCausalLM

    reference_path = fixtures_dir / "gptoss" / "gptoss-q8_0.gguf"
    model = AutoModelForCausalLM.from_pretrained(fixtures_dir / "gptoss" / "hf", dtype=torch.float32)
    ours = gguf.GGUFReader(convert(model, tmp_path / "q8_0.gguf", Q8_0, tokenizer_from=reference_path))
    ref = gguf.GGUFReader(reference_path)
    ours_tensors, ref_tensors = {t.name: t for t in ours.tensors}, {t.name: t for t in ref.tensors}
    assert sorted(ours_tensors) == sorted(ref_tensors)
    for name, t in ref_tensors.items():
        assert ours_tensors[name].tensor_type == t.tensor_type, name
        assert list(ours_tensors[name].shape) == list(t.shape), name
        assert np.array_equal(ours_tensors[name].data, t.data), name
    ours_meta, ref_meta = (metadata(r) for r in (ours, ref))
    assert ours_meta == ref_meta


def metadata(reader: gguf.GGUFReader) -> dict:
    """Hyper-parameter, file-type and tokenizer keys; not the name derived from the directory."""
    naming = {"general.name", "general.size_label"}
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.") and k not in naming}


# ---- a tiny transformers model of our own ----------------------------------------------------

VOCAB, NUM_TOKENS, WINDOW = 300, 40, 8


def gpt_oss_model(seed: int) -> torch.nn.Module:
    from transformers import GptOssConfig

    # Past the window (8) and YaRN's original context (32). `truncate: true` is what the GGUF
    # implies; with head_dim 16 it rounds the ramp to pairs 0-2 instead of 0-1.41.
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}
    config = GptOssConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=128, rope_theta=1e4, rope_scaling=rope, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return build_model(config, seed, special=_gpt_oss_init)


def _gpt_oss_init(name: str, p: torch.nn.Parameter, noise: torch.Tensor) -> bool:
    """gpt-oss stores expert matrices [E, in, out], and its sinks are logits of O(1)."""
    if name.endswith("sinks"):
        p.copy_(noise)
    elif name.endswith("gate_up_proj"):  # x3: some gate/up values pass the clamp limit of 7
        p.copy_(3 * noise / p.shape[1] ** 0.5)
    elif name.endswith("down_proj"):
        p.copy_(noise / p.shape[1] ** 0.5)
    else:
        return False
    return True


def test_tiny_model_float32_matches_transformers(tmp_path):
    model = gpt_oss_model(seed=400)
    ids = torch.randint(0, VOCAB, (NUM_TOKENS,), generator=torch.Generator().manual_seed(400)).tolist()
    with record_gate_up(model) as gate_up:
        want = hf_logits(model, ids)
    assert max(g[..., 0::2].max() for g in gate_up) > SWIGLU_OAI_LIMIT  # the clamps are exercised
    assert min(g[..., 1::2].min() for g in gate_up) < -SWIGLU_OAI_LIMIT

    path = convert(model, tmp_path / "gpt-oss-f32.gguf")
    out = tmp_path / "logits.npy"
    args = ["logits", str(path), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--device", "cpu"]
    assert main(args) == 0
    assert max_abs(np.load(out), want) <= 1e-4


class record_gate_up:
    """Collects every expert's gate_up pre-activations during a transformers forward."""

    def __init__(self, model: torch.nn.Module):
        self.experts = [layer.mlp.experts for layer in model.model.layers]
        self.values: list[torch.Tensor] = []

    def __enter__(self) -> list[torch.Tensor]:
        for e in self.experts:
            e._apply_gate = self._recorder(type(e)._apply_gate.__get__(e))
        return self.values

    def __exit__(self, *exc) -> None:
        for e in self.experts:
            del e._apply_gate

    def _recorder(self, apply_gate):
        def wrapped(gate_up: torch.Tensor) -> torch.Tensor:
            self.values.append(gate_up.detach())
            return apply_gate(gate_up)
        return wrapped
