"""Decode layers as one native call each, the attention front and the routed experts together:
computed in this process (kernels/decode_moe_layer.py), or sent to the one co-located expert
service that hosts them all, over shared memory (expert_backends/direct_hop.py).

A layer qualifies when its experts are all here with native kernels (the backend's `local_layer`),
or at each step when its hop can go direct (the remote backend's `direct_hop`), and its FFN has
nothing the fused call leaves out: no shared expert, no grouped expert selection
(DeepSeek's groups), no input-weighted experts (Llama 4), and the model computes in bfloat16, whose
rounding the fused call repeats. The others keep the per-op FFN after their native front.
"""
from __future__ import annotations

import torch

from splitmoe.attention_service.expert_backends.direct_hop import RemoteMoELayer
from splitmoe.attention_service.model.weights import LayerWeights
from splitmoe.kernels.decode_moe_layer import Gating, LocalMoELayer, Router
from splitmoe.modelfile.architectures.base import ArchSpec
from splitmoe.modelfile.hparams import GATING_SIGMOID, GATING_SOFTMAX, GATING_SOFTMAX_WEIGHT, ModelConfig

# A direct hop's rows: the services' native loop takes a decode step's few rows (larger hops are
# prompts, which take the per-op path and the services' GEMM route).
REMOTE_MAX_ROWS = 16

_GATINGS = {GATING_SOFTMAX: Gating.SOFTMAX, GATING_SIGMOID: Gating.SIGMOID, GATING_SOFTMAX_WEIGHT: Gating.SOFTMAX_WEIGHT}


def native_router(cfg: ModelConfig, layer: LayerWeights) -> Router | None:
    """The layer's routing rule as the native router runs it (model/routing.py `route`'s), or None
    where it needs what only torch's route has (grouped selection)."""
    moe = layer.moe
    groups, used = cfg.num_expert_groups, cfg.num_expert_groups_used
    if moe is None or cfg.expert_gating not in _GATINGS or (1 < groups and 0 < used < groups):
        return None
    return Router(cfg.num_experts, cfg.num_experts_used, _GATINGS[cfg.expert_gating], cfg.expert_weights_norm,
                  cfg.expert_weights_scale, moe.selection_bias)


def fused_layers(cfg: ModelConfig, spec: ArchSpec, layers: list[LayerWeights], fronts: list, experts,
                 dtype: torch.dtype) -> list[LocalMoELayer | RemoteMoELayer | None]:
    """Per layer its fused call, or None where the layer keeps the per-op FFN (module doc).
    `fronts`: the layers' native attention fronts; `experts`: the expert backend."""
    local_layer = getattr(experts, "local_layer", None)
    remote = callable(getattr(experts, "direct_hop", None))
    if dtype != torch.bfloat16 or spec.expert_input_weighted or (local_layer is None and not remote):
        return [None] * len(layers)
    fused: list[LocalMoELayer | RemoteMoELayer | None] = []
    for i, (layer, front) in enumerate(zip(layers, fronts, strict=True)):
        router = native_router(cfg, layer)
        if router is None or layer.moe.shared is not None:
            fused.append(None)
        elif remote:  # whether a step's hop can be direct is asked at each step
            fused.append(RemoteMoELayer(i, front, router, experts, max_tokens=REMOTE_MAX_ROWS))
        else:
            local = local_layer(i)
            fused.append(None if local is None else LocalMoELayer(front, router, local.experts, local.counts,
                                                                  bfloat16=True, max_tokens=local.max_tokens))
    return fused
