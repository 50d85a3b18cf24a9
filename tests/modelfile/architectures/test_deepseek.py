"""deepseek2 (DeepSeek-V2/V2-Lite/V3, R1, Kimi-K2): MLA over a latent KV cache, and V3 routing.

The fixtures (../shared/fixtures/deepseek{2,3}, see its README) are llama.cpp's GGUFs of two tiny
models: deepseek2 has q LoRA, YaRN (factor 40, mscale = mscale_all_dim = 0.707) and softmax greedy
routing; deepseek3 has interleaved rope and sigmoid scores + correction bias + grouped top-k (4
groups, 2 used) + renormalisation + scale 2.5. `hfdeq_<q>` is transformers on the exactly
dequantized weights, with DeepSeek's mscale² softmax factor.

The tiny transformers models run everywhere: V2 with q LoRA and YaRN, V2-Lite (no q LoRA), and V3
(grouped, biased, with the YaRN that V3/Kimi-K2 ship: mscale = mscale_all_dim = 1), converted by
tests/support/hf_to_gguf.py, which is itself checked here against llama.cpp's fixture files.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from splitmoe.attention_service.model import transformer
from splitmoe.attention_service.model.mla import LATENT_ENTRY
from splitmoe.attention_service.model.routing import route
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.cli import main
from splitmoe.modelfile.hparams import GATING_SIGMOID, GATING_SOFTMAX
from tests.support.cpu_paths import PATHS, forced_path
from tests.support.fixture_refs import assert_converter_matches_llama_cpp
from tests.support.hf_reference import build_model, hf_logits, max_abs, rel_l2, token_ids
from tests.support.hf_to_gguf import convert

ARCHS = ["deepseek2", "deepseek3"]
QUANTS = ["q8_0", "q4_k_m"]
# (dtype, forced CPU path) of each run: bfloat16 on this CPU's best path and on the lower one.
RUNS = [("float32", "best"), *(("bfloat16", path) for path in PATHS)]
# A gap in selection score (the probability or biased sigmoid the top-k is taken over; for a
# group, its top-2 sum) between the last chosen and the first left-out that bf16 may close. The
# bf16 weights move these scores by up to ~0.01 in the fixtures.
NEAR_TIE = 0.02


# ---- the llama.cpp fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompt_ids(fixtures_dir) -> list[list[int]]:
    return [p["ids"] for p in json.loads((fixtures_dir / "prompts.json").read_text())["prompts"]]


@pytest.fixture(scope="module")
def runs(fixtures_dir, prompt_ids, tmp_path_factory) -> dict:
    """(arch, quant, dtype, path) -> per prompt (routing per MoE layer, `splitmoe logits` output)."""
    out = tmp_path_factory.mktemp("deepseek") / "logits.npy"
    runs = {}
    for arch in ARCHS:
        for q in QUANTS:
            for dtype, path in RUNS:
                with forced_path(path):
                    runs[arch, q, dtype, path] = [
                        logits_with_routes(fixtures_dir / arch / f"{arch}-{q}.gguf", ids, dtype, out)
                        for ids in prompt_ids]
    return runs


def logits_with_routes(model: Path, ids: list[int], dtype: str, out: Path):
    """(per MoE layer: route's arguments and chosen ids, the logits) of one `splitmoe logits` run."""
    routes = []

    def recording_route(router_logits, top_k, *args, **kwargs):
        chosen, weights = real_route(router_logits, top_k, *args, **kwargs)
        routes.append(((router_logits.float().cpu(), top_k, *args), kwargs, chosen.cpu()))
        return chosen, weights

    real_route = transformer.route
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformer, "route", recording_route)
        args = ["logits", str(model), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--dtype", dtype]
        assert main(args) == 0
    return routes, np.load(out)


def reference(fixtures_dir, arch: str, name: str, prompt: int) -> np.ndarray:
    return np.load(fixtures_dir / arch / "ref" / f"{name}_p{prompt}.npy")


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_matches_transformers_on_dequantized_weights(fixtures_dir, runs, arch, quant):
    for i, (_, got) in enumerate(runs[arch, quant, "float32", "best"]):
        ref = reference(fixtures_dir, arch, f"hfdeq_{quant}", i)
        assert got.shape == ref.shape
        assert max_abs(got, ref) <= 1e-4, f"prompt {i}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_close_to_transformers(fixtures_dir, runs, arch, quant, path):
    """rel-L2 ≤ 3e-2 over the positions whose experts bf16 leaves as float32 chose them.

    deepseek3's sigmoid scores sit in a narrow band and its groups are scored by sums, so bf16
    flips some near-tied choices (prompt 1: 4-5 positions, aggregate rel-L2 7-10e-2, as llama.cpp's
    own q8_0 file is at 9e-2 in the fixtures README). Each flip must be a near-tie in the float32
    run, so a real routing bug still fails.
    """
    for i, ((f32_routes, _), (bf16_routes, got)) in enumerate(
            zip(runs[arch, quant, "float32", "best"], runs[arch, quant, "bfloat16", path])):
        ref = reference(fixtures_dir, arch, f"hfdeq_{quant}", i)
        flipped = routing_flips(f32_routes, bf16_routes)
        for position, (layer, gap) in flipped.items():
            assert gap < NEAR_TIE, f"prompt {i} position {position} layer {layer}: bf16 changed a clear choice"
        kept = [t for t in range(len(ref)) if t not in flipped]
        assert len(kept) >= 0.75 * len(ref), f"prompt {i}: routing flipped at positions {sorted(flipped)}"
        assert rel_l2(got[kept], ref[kept]) <= 3e-2, f"prompt {i}"


def routing_flips(reference_routes, other_routes) -> dict[int, tuple[int, float]]:
    """position -> (first MoE layer whose expert set differs, that layer's selection margin there)."""
    flips: dict[int, tuple[int, float]] = {}
    for layer, ((args, kwargs, ids), (_, _, other_ids)) in enumerate(zip(reference_routes, other_routes)):
        margins = selection_margins(*args, **kwargs)
        for t in range(ids.shape[0]):
            if t not in flips and set(ids[t].tolist()) != set(other_ids[t].tolist()):
                flips[t] = (layer, float(margins[t]))
    return flips


def selection_margins(router_logits, top_k, gating, renormalize, scale=1.0, *, selection_bias=None,
                      num_groups=0, num_groups_used=0) -> torch.Tensor:
    """[T]: the smaller of the group-boundary and expert-boundary gaps in selection score."""
    scores = torch.sigmoid(router_logits) if gating == GATING_SIGMOID else torch.softmax(router_logits, dim=-1)
    if selection_bias is not None:
        scores = scores + selection_bias.float().cpu()
    margin = torch.full((scores.shape[0],), float("inf"))
    if num_groups > 1:
        grouped = scores.view(scores.shape[0], num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        ranked = group_scores.sort(dim=-1, descending=True)
        margin = ranked.values[:, num_groups_used - 1] - ranked.values[:, num_groups_used]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, ranked.indices[:, :num_groups_used], True)
        scores = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
    ranked = scores.sort(dim=-1, descending=True).values
    return torch.minimum(margin, ranked[:, top_k - 1] - ranked[:, top_k])


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_close_to_llama_cpp(fixtures_dir, runs, arch, quant):
    """llama.cpp quantizes activations inside its dot products: compare as the fixtures README says."""
    got = np.concatenate([logits for _, logits in runs[arch, quant, "float32", "best"]])
    ref = np.concatenate([reference(fixtures_dir, arch, f"llamacpp_{quant}", i) for i in range(2)])
    per_position = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert np.median(per_position) < 5e-2
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).mean() >= 0.85


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_token_by_token_equals_prefill(fixtures_dir, prompt_ids, arch):
    r = runner(fixtures_dir / arch / f"{arch}-q8_0.gguf")
    ids = prompt_ids[1]
    prefill = r.step([Sequence(0, ids)], all_logits=True)
    seq = Sequence(1, ids)
    decoded = torch.cat([r.step([seq], [1]) for _ in ids])
    assert torch.abs(decoded - prefill).max().item() <= 1e-4


def runner(path: Path, dtype: torch.dtype = torch.float32) -> ModelRunner:
    # Small KV blocks so a prompt spans many, non-contiguous ones.
    options = RunnerOptions(dtype=dtype, device=torch.device("cpu"), kv_cache_tokens=512, kv_block_tokens=4)
    return ModelRunner.from_gguf(path, options)


@pytest.mark.parametrize("arch", ARCHS)
def test_converter_matches_llama_cpp(fixtures_dir, tmp_path, arch):
    assert_converter_matches_llama_cpp(fixtures_dir / arch, tmp_path)


# ---- tiny transformers models (no fixtures needed) -------------------------------------------

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=96, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=12,
              rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
# YaRN past an original context of 16, over the 40-token sequences below.
YARN = dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
            rope_theta=1e4)
NUM_TOKENS = 40


def v2_config(q_lora_rank: int | None):
    from transformers import DeepseekV2Config

    # V2-Lite's mscale = mscale_all_dim = 0.707; `scoring_func` as real configs state it.
    return DeepseekV2Config(**COMMON, q_lora_rank=q_lora_rank, topk_method="greedy", norm_topk_prob=False,
                            routed_scaling_factor=1.5, scoring_func="softmax",
                            rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})


def v3_config():
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**COMMON, "n_routed_experts": 16, "num_experts_per_tok": 4}, q_lora_rank=32,
                            n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                            scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True,
                            rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})


TINY = {"v2_q_lora_yarn": lambda: v2_config(q_lora_rank=32), "v2_lite": lambda: v2_config(q_lora_rank=None),
        "v3": v3_config}


def build_deepseek(config, seed: int) -> torch.nn.Module:
    model = build_model(config, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "gate", None) and getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:  # a buffer, which build_model's re-initialisation does not reach
                bias.copy_(0.1 * torch.randn(bias.shape, generator=gen))
    set_deepseek_attention_scale(model)
    return model


def set_deepseek_attention_scale(model: torch.nn.Module) -> None:
    """qk_head_dim^-0.5 · mscale², with mscale = 0.1·mscale_all_dim·ln(factor) + 1, on every layer.

    The fixtures' fix for transformers 4.57, whose DeepseekV2Attention dropped the mscale² (README
    divergence 1); transformers 5 computes the same value, so this changes nothing there.
    """
    cfg = model.config
    rope = cfg.rope_parameters
    scale = cfg.qk_head_dim ** -0.5
    if rope.get("rope_type") == "yarn" and rope.get("mscale_all_dim"):
        scale *= (0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1) ** 2
    for layer in model.model.layers:
        layer.self_attn.scaling = scale


@pytest.fixture(scope="module", params=list(TINY))
def tiny(request, tmp_path_factory):
    """(model, ids, transformers' float32 logits, f32 GGUF)."""
    name = request.param
    seed = 400 + list(TINY).index(name)
    model = build_deepseek(TINY[name](), seed)
    ids = token_ids(NUM_TOKENS, seed)
    path = convert(model, tmp_path_factory.mktemp(name) / f"{name}-f32.gguf")
    return model, ids, hf_logits(model, ids), path


def test_tiny_float32_matches_transformers(tiny, tmp_path):
    _, ids, ref, path = tiny
    out = tmp_path / "logits.npy"
    args = ["logits", str(path), "--token-ids", ",".join(map(str, ids)), "--out", str(out), "--dtype", "float32",
            "--device", "cpu"]
    assert main(args) == 0
    assert max_abs(np.load(out), ref) <= 1e-4


def test_tiny_decode_equals_prefill(tiny):
    _, ids, ref, path = tiny
    r, seq = runner(path), Sequence(0, ids)
    decoded = torch.cat([r.step([seq], [1]) for _ in ids]).numpy()
    assert max_abs(decoded, ref) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_holds_the_latent_not_expanded_heads(tiny, dtype):
    """Per token and layer: kv_lora + rope values, not n_head × (key + value) of expanded MHA."""
    model, _, _, path = tiny
    c = model.config
    r = runner(path, dtype)
    latent_bytes = (c.kv_lora_rank + c.qk_rope_head_dim) * dtype.itemsize * c.num_hidden_layers
    expanded_bytes = (c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)
                      * dtype.itemsize * c.num_hidden_layers)
    assert r.model.kv_entry_shapes() == {LATENT_ENTRY: (c.kv_lora_rank + c.qk_rope_head_dim,)}
    assert r.kv.bytes_per_token == latent_bytes < expanded_bytes


# ---- routing ---------------------------------------------------------------------------------


def test_v3_routing_bias_selects_but_does_not_weight():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    ids, weights = route(logits, 2, GATING_SIGMOID, True, 2.5, selection_bias=bias)
    assert set(ids[0].tolist()) == {0, 3}
    chosen = torch.sigmoid(logits[0, ids[0]])
    torch.testing.assert_close(weights[0], chosen / chosen.sum() * 2.5)


def test_v3_grouped_top_k_scores_groups_by_their_best_two():
    # Group 0 holds the single best expert, group 1 the best pair (sums 0.96 < 1.2): group 1 wins.
    scores = torch.tensor([[0.95, 0.01, 0.6, 0.6]])
    ids, _ = route(scores.logit(), 2, GATING_SIGMOID, False, num_groups=2, num_groups_used=1)
    assert set(ids[0].tolist()) == {2, 3}
    ids, _ = route(scores.logit(), 2, GATING_SIGMOID, False)  # ungrouped: expert 0 is in
    assert 0 in ids[0].tolist()


def test_v2_softmax_greedy_is_unchanged_by_the_new_arguments():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    plain = route(logits, 2, GATING_SOFTMAX, False, 1.5)
    grouped_off = route(logits, 2, GATING_SOFTMAX, False, 1.5, num_groups=1, num_groups_used=1)
    for a, b in zip(plain, grouped_off):
        assert torch.equal(a, b)
