"""Non-expert weights of a GGUF model, dequantized at load onto the attention device.

Tensor names are llama.cpp's (`blk.N.attn_q.weight`, ...). The router and norms stay float32,
because routing decisions and normalisation are where low precision hurts most.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attention_service.models.base import (QK_NORM_NONE, SHARED_EXPERT_GATED, SHARED_EXPERT_NONE,
                                           ArchSpec)
from kernels.quants import dequantize
from modelfile.gguf_file import GGUFError, GGUFFile
from modelfile.hparams import ModelConfig


@dataclass
class AttentionWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass
class DenseFFNWeights:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class MoEWeights:
    """The attention side of an MoE layer: router and shared expert. Routed experts live elsewhere."""

    router: torch.Tensor
    shared: DenseFFNWeights | None = None
    shared_gate: torch.Tensor | None = None


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    attn: AttentionWeights
    ffn_norm: torch.Tensor
    dense_ffn: DenseFFNWeights | None
    moe: MoEWeights | None


@dataclass
class ModelWeights:
    token_embedding: torch.Tensor
    layers: list[LayerWeights]
    output_norm: torch.Tensor
    output: torch.Tensor


class _Loader:
    def __init__(self, g: GGUFFile, dtype: torch.dtype, device: torch.device):
        self.g, self.dtype, self.device = g, dtype, device

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.g.tensor(name)).to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self(name, dtype) if self.g.has(name) else None

    def norm(self, name: str) -> torch.Tensor:
        return self(name, torch.float32)


def load_weights(g: GGUFFile, spec: ArchSpec, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    load = _Loader(g, dtype, device)
    embedding = load("token_embd.weight")
    output = load.optional("output.weight")
    return ModelWeights(
        token_embedding=embedding,
        layers=[_load_layer(load, spec, cfg, i) for i in range(cfg.num_layers)],
        output_norm=load.norm("output_norm.weight"),
        output=embedding if output is None else output,  # tied embeddings
    )


def _load_layer(load: _Loader, spec: ArchSpec, cfg: ModelConfig, i: int) -> LayerWeights:
    p = f"blk.{i}."
    is_moe = load.g.has(p + "ffn_gate_inp.weight")
    return LayerWeights(
        attn_norm=load.norm(p + "attn_norm.weight"),
        attn=_load_attention(load, spec, p),
        ffn_norm=load.norm(p + "ffn_norm.weight"),
        dense_ffn=None if is_moe else _load_dense(load, p, ""),
        moe=_load_moe(load, spec, p) if is_moe else None,
    )


def _load_attention(load: _Loader, spec: ArchSpec, p: str) -> AttentionWeights:
    bias = load if spec.qkv_bias else load.optional
    has_norm = spec.qk_norm != QK_NORM_NONE
    return AttentionWeights(
        q=load(p + "attn_q.weight"), k=load(p + "attn_k.weight"), v=load(p + "attn_v.weight"),
        out=load(p + "attn_output.weight"),
        q_bias=bias(p + "attn_q.bias"), k_bias=bias(p + "attn_k.bias"), v_bias=bias(p + "attn_v.bias"),
        q_norm=load.norm(p + "attn_q_norm.weight") if has_norm else None,
        k_norm=load.norm(p + "attn_k_norm.weight") if has_norm else None,
    )


def _load_dense(load: _Loader, p: str, suffix: str) -> DenseFFNWeights:
    return DenseFFNWeights(gate=load(f"{p}ffn_gate{suffix}.weight"), up=load(f"{p}ffn_up{suffix}.weight"),
                           down=load(f"{p}ffn_down{suffix}.weight"))


def _load_moe(load: _Loader, spec: ArchSpec, p: str) -> MoEWeights:
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
    return MoEWeights(router=router, shared=shared, shared_gate=shared_gate)
