"""Non-expert weights of a GGUF model, loaded onto the attention device.

Tensor names are llama.cpp's (`blk.N.attn_q.weight`, ...). The router and norms stay float32,
because routing decisions and normalisation are where low precision hurts most. Linear weights
and the token embedding are dense tensors, or in the fast mode (bfloat16 on the CPU) the file's
quantized blocks (kernels/linear.py: QuantLinear, QuantEmbedding); see weight_loader.py.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from splitmoe.attention_service.model.attention_kinds import attention_class
from splitmoe.attention_service.model.weight_loader import WeightLoader
from splitmoe.kernels.expert_kernels import format_ranges
from splitmoe.kernels.linear import LinearGroup, LinearWeight, QuantEmbedding
from splitmoe.modelfile.architectures.base import SHARED_EXPERT_GATED, SHARED_EXPERT_NONE, ArchSpec
from splitmoe.modelfile.expert_tensors import expert_tensor_names, moe_layers
from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile
from splitmoe.modelfile.hparams import ModelConfig

_LAYER = re.compile(r"blk\.(\d+)\.")
log = logging.getLogger(__name__)


@dataclass
class DenseFFNWeights:
    gate: LinearWeight
    up: LinearWeight
    down: LinearWeight
    gate_up: LinearGroup = field(init=False)  # gate and up in one call where that is faster

    def __post_init__(self) -> None:
        self.gate_up = LinearGroup(self.gate, self.up)


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
    rope_freqs: torch.Tensor | None = None  # float32 [rope dims / 2]: llama3-style per-pair divisors


def load_weights(g: GGUFFile, spec: ArchSpec, cfg: ModelConfig, dtype: torch.dtype,
                 device: torch.device) -> ModelWeights:
    load = WeightLoader(g, dtype, device)
    vocab = (cfg.vocab_size, cfg.hidden_size)
    embedding = load.embedding("token_embd.weight", vocab)
    output = load.linear_optional("output.weight", vocab)
    if output is None:  # tied embeddings: the same tensor, or a QuantLinear over the same blocks
        output = embedding if isinstance(embedding, torch.Tensor) else load.linear("token_embd.weight", vocab)
    weights = ModelWeights(
        token_embedding=embedding,
        layers=[load_layer(load, spec, cfg, i) for i in range(cfg.num_layers)],
        output_norm=load.norm("output_norm.weight", (cfg.hidden_size,)),
        output=output,
        rope_freqs=load.optional("rope_freqs.weight", (cfg.rope_dims // 2,), torch.float32),
    )
    _check_every_tensor_read(g, cfg, load.used)
    return weights


def load_layer(load: WeightLoader, spec: ArchSpec, cfg: ModelConfig, i: int) -> LayerWeights:
    p = f"blk.{i}."
    is_moe = load.g.has(p + "ffn_gate_inp.weight")
    step = cfg.moe_layer_interval
    if step and is_moe != ((i + 1) % step == 0):
        raise GGUFError(f"{load.g.path.name}: layer {i} {'has' if is_moe else 'lacks'} a router "
                        f"('{p}ffn_gate_inp.weight'), against metadata key '{load.g.arch}.interleave_moe_layer_step' "
                        f"= {step}")
    return LayerWeights(
        attn_norm=load.norm(p + "attn_norm.weight", (cfg.hidden_size,)),
        attn=attention_class(spec).load_weights(load, spec, cfg, p),
        ffn_norm=load.norm(f"{p}{spec.ffn_norm}.weight", (cfg.hidden_size,)),
        dense_ffn=None if is_moe else _load_dense(load, cfg, p, "", cfg.dense_ffn),
        moe=_load_moe(load, spec, cfg, p) if is_moe else None,
    )


def _load_dense(load: WeightLoader, cfg: ModelConfig, p: str, suffix: str, width: int) -> DenseFFNWeights:
    """`width`: the FFN width the file states, or 0 where it states none; then the gate's is taken,
    and up and down must agree with it."""
    gate = f"{p}ffn_gate{suffix}.weight"
    width = width or load.g.tensor(gate).shape[0]
    D = cfg.hidden_size
    return DenseFFNWeights(gate=load.linear(gate, (width, D)),
                           up=load.linear(f"{p}ffn_up{suffix}.weight", (width, D)),
                           down=load.linear(f"{p}ffn_down{suffix}.weight", (D, width)))


def _load_moe(load: WeightLoader, spec: ArchSpec, cfg: ModelConfig, p: str) -> MoEWeights:
    E, D = cfg.num_experts, cfg.hidden_size
    shared = None
    if spec.shared_expert != SHARED_EXPERT_NONE:
        shared = _load_dense(load, cfg, p, "_shexp", cfg.shared_expert_ffn)
    shared_gate = None
    if spec.shared_expert == SHARED_EXPERT_GATED:
        shared_gate = load.norm(p + "ffn_gate_inp_shexp.weight", (1, D))
    f32 = torch.float32
    return MoEWeights(router=load.norm(p + "ffn_gate_inp.weight", (E, D)), shared=shared, shared_gate=shared_gate,
                      router_bias=load.optional(p + "ffn_gate_inp.bias", (E,), f32),
                      selection_bias=load.optional(p + "exp_probs_b.bias", (E,), f32))


def _check_every_tensor_read(g: GGUFFile, cfg: ModelConfig, used: set[str]) -> None:
    """Every tensor of the file is one the model reads, here or on the expert side.

    As llama.cpp counts them: a tensor nothing reads is a file that is not what its metadata says
    (a renamed `output.weight` would otherwise pass as tied embeddings, a `block_count` too small
    would silently drop layers). The NextN/MTP layers past the last one are skipped, and logged.
    """
    known = set(used)
    for layer in moe_layers(g):
        known |= expert_tensor_names(g, layer)
    nextn = []
    for name in g.tensor_names:
        if name in known:
            continue
        match = _LAYER.match(name)
        if match and cfg.num_layers <= int(match.group(1)) < cfg.num_layers + cfg.num_nextn_layers:
            nextn.append(name)
            continue
        if match and int(match.group(1)) >= cfg.num_layers:
            raise GGUFError(f"{g.path.name}: tensor {name!r} is past the last layer "
                            f"({g.arch}.block_count = {cfg.num_layers})")
        raise GGUFError(f"{g.path.name}: tensor {name!r} is unknown to a {g.arch} model of these hyper-parameters")
    if nextn:
        # As llama.cpp's main forward pass: the MTP block predicts further tokens for speculative
        # decoding, which SplitMoE does not do.
        log.info("%s: skipping the NextN/MTP %s (%d tensors, %s.nextn_predict_layers = %d): not used for generation",
                 g.path.name, format_ranges("layers", range(cfg.num_layers, cfg.num_layers + cfg.num_nextn_layers)),
                 len(nextn), g.arch, cfg.num_nextn_layers)
