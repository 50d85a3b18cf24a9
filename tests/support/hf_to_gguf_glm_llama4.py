"""hf_to_gguf.py's part for GLM-4.5 (Glm4MoeModel) and Llama 4 (Llama4Model in convert_hf_to_gguf.py).

* glm4moe: the generic names, with `post_attention_layernorm` as `post_attention_norm`, the
  correction bias as `exp_probs_b.bias`, `shared_experts` as `_shexp`; rope dims = head_dim ·
  partial_rotary_factor; NextN layers (`num_nextn_predict_layers`) counted in block_count.
* llama4: `feed_forward.*`; the fused experts are stored input-major ([E, H, 2F], [E, F, H]) and
  transposed; llama3 rope scaling becomes the `rope_freqs` divisors; feed_forward_length is the
  dense layers' `intermediate_size_mlp`. A config whose chunk or temperature differs from llama.cpp's
  constants gets SplitMoE's own `llama4.splitmoe.*` keys (modelfile/architectures/llama4.py).
"""
from __future__ import annotations

import math
import re
from typing import Any

import gguf
import torch

# llama.cpp's constants for llama4 (modelfile/architectures/llama4.py).
_LLAMA4_CHUNK, _LLAMA4_FLOOR, _LLAMA4_SCALE, _LLAMA4_NOPE_INTERVAL = 8192, 8192, 0.1, 4


def glm4moe_view(hp: dict[str, Any]) -> dict[str, Any]:
    """What the generic keys see: experts under `n_routed_experts`, NextN layers in the count."""
    layers = hp["num_hidden_layers"] + hp.get("num_nextn_predict_layers", 0)
    return {**hp, "num_experts": hp["n_routed_experts"], "num_hidden_layers": layers}


def write_glm4moe_hparams(w: gguf.GGUFWriter, hp: dict[str, Any], rope: dict[str, Any]) -> None:
    partial = rope.get("partial_rotary_factor", hp.get("partial_rotary_factor", 0.5))
    w.add_rope_dimension_count(int(hp["head_dim"] * partial))
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_expert_group_count(hp["n_group"])
    w.add_expert_group_used_count(hp["topk_group"])
    w.add_nextn_predict_layers(hp.get("num_nextn_predict_layers", 0))


def llama4_view(hp: dict[str, Any]) -> dict[str, Any]:
    """The dense layers' FFN is `intermediate_size_mlp`; `intermediate_size` is the experts'."""
    return {**hp, "intermediate_size": hp["intermediate_size_mlp"], "expert_intermediate_size": hp["intermediate_size"]}


def write_llama4_hparams(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    if hp.get("no_rope_layer_interval", _LLAMA4_NOPE_INTERVAL) != _LLAMA4_NOPE_INTERVAL:
        raise ValueError("llama.cpp's llama4 has NoPE every 4th layer; no GGUF key says otherwise")
    w.add_vocab_size(hp["vocab_size"])
    w.add_rope_dimension_count(hp["head_dim"])
    w.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
    w.add_expert_feed_forward_length(hp["expert_intermediate_size"])
    if all(t == "full_attention" for t in hp.get("layer_types", ["chunked_attention"])):
        w.add_sliding_window(0)
        return
    overrides = {"attention_chunk_tokens": (hp.get("attention_chunk_size"), _LLAMA4_CHUNK),
                 "attention_temperature_floor_tokens": (hp.get("floor_scale"), _LLAMA4_FLOOR)}
    for key, (value, default) in overrides.items():
        if value is not None and value != default:
            w.add_uint32(f"llama4.splitmoe.{key}", int(value))
    if hp.get("attn_scale", _LLAMA4_SCALE) != _LLAMA4_SCALE:
        w.add_float32("llama4.splitmoe.attention_temperature_scale", float(hp["attn_scale"]))


def llama3_rope_freqs(hp: dict[str, Any], rope: dict[str, Any]) -> torch.Tensor:
    """LlamaModel.generate_extra_tensors: per pair, 1 (high frequency), factor (low), or smoothed."""
    dim = hp["head_dim"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32)


_LAYER = r"model\.layers\.(?P<i>\d+)\."
_GLM_NAMES = [(re.compile(pattern), name) for pattern, name in [
    (_LAYER + r"post_attention_layernorm\.weight", "blk.{i}.post_attention_norm.weight"),
    (_LAYER + r"mlp\.gate\.e_score_correction_bias", "blk.{i}.exp_probs_b.bias"),
    (_LAYER + r"mlp\.shared_experts\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}_shexp.weight"),
    (_LAYER + r"mlp\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}.weight"),  # leading dense layers
]]
_LLAMA4_NAMES = [(re.compile(pattern), name) for pattern, name in [
    (_LAYER + r"feed_forward\.router\.weight", "blk.{i}.ffn_gate_inp.weight"),
    (_LAYER + r"feed_forward\.shared_expert\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}_shexp.weight"),
    (_LAYER + r"feed_forward\.(?P<m>gate|up|down)_proj\.weight", "blk.{i}.ffn_{m}.weight"),  # dense layers
]]


def glm4moe_tensors(state: dict[str, torch.Tensor], generic_name) -> dict[str, torch.Tensor]:
    """state: hf_to_gguf's split and stacked float32 state dict."""
    return {_renamed(name, _GLM_NAMES, generic_name): t for name, t in state.items()}


def llama4_tensors(model: torch.nn.Module, hp: dict[str, Any], rope: dict[str, Any],
                   generic_name) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().to(torch.float32).cpu()
        if name == "lm_head.weight" and hp.get("tie_word_embeddings", False):
            continue
        if m := re.fullmatch(_LAYER + r"feed_forward\.experts\.gate_up_proj", name):
            gate, up = t.transpose(1, 2).chunk(2, dim=1)  # [E, H, 2F] -> [E, 2F, H], gate rows first
            out[f"blk.{m['i']}.ffn_gate_exps.weight"] = gate.contiguous()
            out[f"blk.{m['i']}.ffn_up_exps.weight"] = up.contiguous()
        elif m := re.fullmatch(_LAYER + r"feed_forward\.experts\.down_proj", name):
            out[f"blk.{m['i']}.ffn_down_exps.weight"] = t.transpose(1, 2).contiguous()
        else:
            out[_renamed(name, _LLAMA4_NAMES, generic_name)] = t
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_freqs(hp, rope)
    return out


def _renamed(name: str, names, generic_name) -> str:
    for pattern, gguf_name in names:
        if m := pattern.fullmatch(name):
            return gguf_name.format(**m.groupdict())
    return generic_name(name)
