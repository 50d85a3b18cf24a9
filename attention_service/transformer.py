"""The decoder stack every supported architecture shares, wired by its ArchSpec.

Per layer: RMSNorm -> attention over the paged KV cache -> residual -> RMSNorm -> FFN -> residual,
where the FFN is either dense SwiGLU or MoE (router here, routed experts through the
ExpertBackend once per layer, shared expert here).
"""
from __future__ import annotations

import torch

from attention_service.batch import StepBatch
from attention_service.experts_client import ExpertBackend
from attention_service.kv_cache import KVCache
from attention_service.layers import linear, rms_norm, swiglu
from attention_service.models.base import ArchSpec
from attention_service.routing import limit_experts, route
from attention_service.weights import LayerWeights, ModelWeights
from modelfile.hparams import GATING_SOFTMAX_WEIGHT, ModelConfig


class MoETransformer:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, weights: ModelWeights, experts: ExpertBackend):
        self.cfg, self.spec, self.weights, self.experts = cfg, spec, weights, experts
        self.attention = spec.attention(cfg, spec, weights.token_embedding.device)
        self.dtype = weights.token_embedding.dtype

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.attention.kv_entry_shapes()

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Float32 logits [len(batch.logits_rows), vocab]."""
        w, eps = self.weights, self.cfg.norm_eps
        # The residual stream stays float32 whatever the weights' dtype: in bfloat16 its rounding
        # is what flips near-tied routing decisions.
        x = w.token_embedding[batch.token_ids].float()
        for i, layer in enumerate(w.layers):
            x = x + self.attention(i, layer.attn, rms_norm(x, layer.attn_norm, eps).to(self.dtype), batch, kv)
            x = x + self._ffn(i, layer, rms_norm(x, layer.ffn_norm, eps), batch)
        x = rms_norm(x[batch.logits_rows], w.output_norm, eps).to(self.dtype)
        return linear(x, w.output).float()

    def _ffn(self, i: int, layer: LayerWeights, h32: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """h32: the normed input in float32; the router and gates read it before rounding."""
        h = h32.to(self.dtype)
        if layer.moe is None:
            f = layer.dense_ffn
            return swiglu(h, f.gate, f.up, f.down)
        w, c = layer.moe, self.cfg
        per_token = batch.experts_per_token
        top_k = c.num_experts_used if per_token is None else int(per_token.max())
        ids, weights = route(linear(h32, w.router, w.router_bias), top_k, c.expert_gating,
                             c.expert_weights_norm, c.expert_weights_scale, selection_bias=w.selection_bias,
                             num_groups=c.num_expert_groups, num_groups_used=c.num_expert_groups_used)
        if per_token is not None:
            renormalized = c.expert_weights_norm or c.expert_gating == GATING_SOFTMAX_WEIGHT
            ids, weights = limit_experts(ids, weights, per_token, renormalized)
        out = self.experts.forward(i, h, ids, weights).float()
        if w.shared is not None:
            shared = swiglu(h, w.shared.gate, w.shared.up, w.shared.down).float()
            if w.shared_gate is not None:
                shared = shared * torch.sigmoid(linear(h32, w.shared_gate))
            out = out + shared
        return out
