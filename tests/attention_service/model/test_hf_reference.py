"""The runtime against transformers on tiny random models of every architecture (no fixtures needed).

Each model is built from its transformers config class with sizes unlike the fixtures', given
weights that keep activations O(1), run in float32 with eager attention and eager experts, and
converted to GGUF by tests/support/hf_to_gguf.py (itself checked against llama.cpp's files in
test_hf_to_gguf_layout.py). `splitmoe logits` must then reproduce transformers' logits at
every position: to float32 rounding for f32 weights, and for Q8_0 weights against transformers
run on the same Q8_0-rounded weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from splitmoe.attention_service.model import transformer
from tests.support.hf_reference import (
    NEAR_TIE,
    VOCAB,
    build_model,
    hf_logits,
    max_abs,
    rel_l2,
    routing_flips,
    splitmoe_logits,
    token_ids,
)
from tests.support.hf_to_gguf import F32, Q8_0, convert

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
              max_position_embeddings=256, tie_word_embeddings=False,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)  # config defaults lie outside VOCAB


def qwen3moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**COMMON, **dict(
        num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6), **overrides})


def qwen2moe_config():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**{**COMMON, **dict(
        num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=64, shared_expert_intermediate_size=96,
        num_experts=16, num_experts_per_tok=4, norm_topk_prob=False, qkv_bias=True, rms_norm_eps=1e-6,
        rope_theta=1e6)})


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(**{**COMMON, **dict(
        num_key_value_heads=2, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1e6, sliding_window=None)})


def olmoe_config():
    from transformers import OlmoeConfig

    # OLMoE's own choice: full multi-head attention, with q/k norm over the whole projection.
    return OlmoeConfig(**{**COMMON, **dict(
        num_key_value_heads=4, intermediate_size=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=1e4)})


def dbrx_config():
    from transformers import DbrxConfig

    # clip_qkv 1.5 clamps ~13 % of the first layer's q/k/v values (test_dbrx_clip_qkv_is_active).
    return DbrxConfig(d_model=64, n_heads=4, n_layers=3, max_seq_len=256, vocab_size=VOCAB, tie_word_embeddings=False,
                      attn_config=dict(clip_qkv=1.5, kv_n_heads=2, rope_theta=1e4),
                      ffn_config=dict(ffn_hidden_size=32, moe_num_experts=8, moe_top_k=3,
                                      moe_normalize_expert_weights=1.0),
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)


CONFIGS = {"qwen3moe": qwen3moe_config, "qwen2moe": qwen2moe_config, "mixtral": mixtral_config,
           "olmoe": olmoe_config, "dbrx": dbrx_config}


@dataclass
class Case:
    arch: str
    model: torch.nn.Module
    ids: list[int]
    reference: np.ndarray  # transformers' float32 logits [n_tokens, vocab]
    f32_gguf: Path


@pytest.fixture(scope="module", params=list(CONFIGS))
def case(request, tmp_path_factory) -> Case:
    arch = request.param
    seed = 100 + list(CONFIGS).index(arch)
    model = build_model(CONFIGS[arch](), seed)
    ids = token_ids(20, seed)
    path = convert(model, tmp_path_factory.mktemp(arch) / f"{arch}-f32.gguf")
    return Case(arch, model, ids, hf_logits(model, ids), path)


def test_float32_matches_transformers(case):
    assert max_abs(splitmoe_logits(case.f32_gguf, case.ids), case.reference) <= 1e-4


# A router-logit gap between the k-th and (k+1)-th expert that bf16 rounding may close.
def test_bfloat16_close_to_transformers(case, monkeypatch):
    """bf16 weights move every logit by ~0.5 %; where that flips a near-tied expert choice, one
    position moves by up to ~30 % (a different expert is a different function), as llama.cpp's
    quantized files do in the fixtures README. The bound holds over the other positions; each
    flip must be a near-tie in the float32 run, so a real routing bug still fails."""
    f32_routes, _ = routed_logits(monkeypatch, case, "float32")
    bf16_routes, got = routed_logits(monkeypatch, case, "bfloat16")
    flipped = routing_flips(f32_routes, bf16_routes)
    for position, (layer, logit_gap) in flipped.items():
        assert logit_gap < NEAR_TIE, f"position {position}, layer {layer}: bf16 changed a clear choice"
    kept = [t for t in range(len(case.ids)) if t not in flipped]
    assert len(kept) >= 0.75 * len(case.ids), f"routing flipped at positions {sorted(flipped)}"
    assert rel_l2(got[kept], case.reference[kept]) <= 3e-2


def routed_logits(monkeypatch, case: Case, dtype: str):
    """(per MoE layer: the router logits [T, E] and chosen ids [T, K], the logits) of one run."""
    routes = []

    def recording_route(router_logits, top_k, *args, **kwargs):
        ids, weights = real_route(router_logits, top_k, *args, **kwargs)
        routes.append((router_logits.float(), ids))
        return ids, weights

    real_route = transformer.route
    monkeypatch.setattr(transformer, "route", recording_route)
    got = splitmoe_logits(case.f32_gguf, case.ids, dtype)
    monkeypatch.setattr(transformer, "route", real_route)
    return routes, got


def test_q8_0_matches_transformers_on_dequantized_weights(case, tmp_path):
    path = convert(case.model, tmp_path / f"{case.arch}-q8_0.gguf", Q8_0)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == Q8_0 and types["blk.0.ffn_gate_inp.weight"] == F32
    dequantized = build_model(case.model.config, seed=0)
    dequantized.load_state_dict(q8_0_rounded(case.model.state_dict(), case.model.config))
    assert max_abs(splitmoe_logits(path, case.ids), hf_logits(dequantized, case.ids)) <= 1e-3


def q8_0_rounded(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The weights llama-quantize's Q8_0 leaves, mapped back to transformers' tensors.

    Q8_0 blocks run along the last (input) dim of every matrix, which the converter reorders only
    in DBRX's `w2` (stored transposed per expert); elsewhere it permutes rows, splits gate/up by
    rows, stacks experts, so rounding the transformers tensors row by row gives exactly the
    dequantized GGUF. The routers and the [1, D] shared-expert gate stay F32, as every 1-D tensor does.
    """
    def quantized(name: str, t: torch.Tensor) -> bool:
        matrix = t.ndim >= 2 and t.shape[0] > 1
        return matrix and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "router.layer.weight"))

    def rounded(t: torch.Tensor) -> torch.Tensor:
        data = gguf.quants.quantize(t.contiguous().numpy(), Q8_0)
        return torch.from_numpy(gguf.quants.dequantize(data, Q8_0).reshape(t.shape))

    out = {}
    for name, t in state.items():
        if name.endswith("experts.mlp.w2"):  # DBRX: rows of F along each expert's [H, F]
            per_expert = t.view(config.ffn_config.moe_num_experts, -1, t.shape[-1]).transpose(1, 2)
            t = rounded(per_expert).transpose(1, 2).reshape(t.shape)
        elif quantized(name, t):
            t = rounded(t)
        out[name] = t
    return out


def test_mixtral_per_expert_layout(tmp_path):
    """The old Mixtral files: one blk.N.ffn_{gate,up,down}.E.weight per expert."""
    model = build_model(mixtral_config(), seed=200)
    ids = token_ids(20, seed=200)
    path = convert(model, tmp_path / "mixtral-per-expert.gguf", per_expert_tensors=True)
    names = {t.name for t in gguf.GGUFReader(path).tensors}
    assert "blk.2.ffn_down.7.weight" in names and not any("_exps" in n for n in names)
    assert max_abs(splitmoe_logits(path, ids), hf_logits(model, ids)) <= 1e-4


def test_qwen3moe_yarn_rope_scaling(tmp_path):
    """YaRN, on a sequence past the original context of 32.

    With head_dim 16 and theta 1e4 the ramp spans pairs 0-2: pair 0 keeps its frequency, pair 1
    is half interpolated, the rest fully, and cos/sin grow by 1 + 0.1 ln 4.
    """
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    # max_position_embeddings = factor x original, as real YaRN configs state it.
    config = qwen3moe_config(rope_scaling=rope, rope_theta=1e4, max_position_embeddings=128)
    model = build_model(config, seed=300)
    ids = token_ids(48, seed=300)
    path = convert(model, tmp_path / "qwen3moe-yarn.gguf")
    meta = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}
    assert meta["qwen3moe.rope.scaling.type"] == "yarn"
    assert meta["qwen3moe.rope.scaling.factor"] == 4.0
    assert meta["qwen3moe.rope.scaling.original_context_length"] == 32
    assert max_abs(splitmoe_logits(path, ids), hf_logits(model, ids)) <= 1e-4


def test_dbrx_clip_qkv_is_active(tmp_path):
    """The clamp of the tiny DBRX changes transformers' logits by far more than the tests' bounds,
    so its tests fail without it."""
    model = build_model(dbrx_config(), seed=100 + list(CONFIGS).index("dbrx"))
    ids = token_ids(20, seed=0)
    clamped = hf_logits(model, ids)
    for block in model.transformer.blocks:
        block.norm_attn_norm.attn.clip_qkv = 1e9
    assert max_abs(hf_logits(model, ids), clamped) > 0.05
