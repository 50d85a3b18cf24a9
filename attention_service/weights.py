"""Non-expert weights of a GGUF model, loaded onto the attention device.

Tensor names are llama.cpp's (`blk.N.attn_q.weight`, ...). The router and norms stay float32,
because routing decisions and normalisation are where low precision hurts most. Linear weights
and the token embedding are dense tensors, or in the fast mode (bfloat16 on the CPU) the file's
quantized blocks (kernels/linear.py: QuantLinear, QuantEmbedding); see weight_loader.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attention_service.models.base import SHARED_EXPERT_GATED, SHARED_EXPERT_NONE, ArchSpec
from attention_service.weight_loader import WeightLoader
from kernels.linear import LinearWeight, QuantEmbedding
from modelfile.gguf_file import GGUFError, GGUFFile
from modelfile.hparams import ModelConfig


@dataclass
class DenseFFNWeights:
    gate: LinearWeight
    up: LinearWeight
    down: LinearWeight


@dataclass
class MoEWeights:
    """The attention side of an MoE layer: router and shared expert. Routed experts live elsewhere."""

    router: torch.Tensor
    shared: DenseFFNWeights | None = None
    shared_gate: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None  # gpt-oss
    # DeepSeek-V3 `exp_probs_b.bias` [E] float32: steers which experts win, not their weights.
    selection_bias: torch.Tensor | None = None


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    attn: Any  # the architecture's attention weights (attention.py, mla.py)
    ffn_norm: torch.Tensor
    dense_ffn: DenseFFNWeights | None
    moe: MoEWeights | None


@dataclass
class ModelWeights:
    token_embedding: torch.Tensor | QuantEmbedding  # `[ids]` gives rows; `.dtype` is the compute dtype
    layers: list[LayerWeights]
    output_norm: torch.Tensor
    output: LinearWeight


def load_weights(g: GGUFFile, spec: ArchSpec, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    load = WeightLoader(g, dtype, device)
    embedding = load.embedding("token_embd.weight")
    output = load.linear_optional("output.weight")
    if output is None:  # tied embeddings: the same tensor, or a QuantLinear over the same blocks
        output = embedding if isinstance(embedding, torch.Tensor) else load.linear("token_embd.weight")
    return ModelWeights(
        token_embedding=embedding,
        layers=[_load_layer(load, spec, cfg, i) for i in range(cfg.num_layers)],
        output_norm=load.norm("output_norm.weight"),
        output=output,
    )


def _load_layer(load: WeightLoader, spec: ArchSpec, cfg: ModelConfig, i: int) -> LayerWeights:
    p = f"blk.{i}."
    is_moe = load.g.has(p + "ffn_gate_inp.weight")
    return LayerWeights(
        attn_norm=load.norm(p + "attn_norm.weight"),
        attn=spec.attention.load_weights(load, spec, p),
        ffn_norm=load.norm(f"{p}{spec.ffn_norm}.weight"),
        dense_ffn=None if is_moe else _load_dense(load, p, ""),
        moe=_load_moe(load, spec, p) if is_moe else None,
    )


def _load_dense(load: WeightLoader, p: str, suffix: str) -> DenseFFNWeights:
    return DenseFFNWeights(gate=load.linear(f"{p}ffn_gate{suffix}.weight"),
                           up=load.linear(f"{p}ffn_up{suffix}.weight"),
                           down=load.linear(f"{p}ffn_down{suffix}.weight"))


def _load_moe(load: WeightLoader, spec: ArchSpec, p: str) -> MoEWeights:
    shared = None
    if spec.shared_expert != SHARED_EXPERT_NONE:
        shared = _load_dense(load, p, "_shexp")
    shared_gate = None
    if spec.shared_expert == SHARED_EXPERT_GATED:
        # llama-quantize drops the trailing 1 of [1, D], so this may be 1-D.
        shared_gate = load.norm(p + "ffn_gate_inp_shexp.weight").reshape(1, -1)
    router = load.norm(p + "ffn_gate_inp.weight")
    if router.ndim != 2:
        raise GGUFError(f"{load.g.path.name}: tensor {p}ffn_gate_inp.weight has shape {list(router.shape)}, expected 2-D")
    return MoEWeights(router=router, shared=shared, shared_gate=shared_gate,
                      router_bias=load.optional(p + "ffn_gate_inp.bias", torch.float32),
                      selection_bias=load.optional(p + "exp_probs_b.bias", torch.float32))
