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
from attention_service.layers import Rope, attention, linear, rms_norm, route, softmax_scale, swiglu
from attention_service.models.base import QK_NORM_FULL, QK_NORM_PER_HEAD, ArchSpec
from attention_service.weights import AttentionWeights, LayerWeights, ModelWeights
from modelfile.hparams import ModelConfig


class MoETransformer:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, weights: ModelWeights, experts: ExpertBackend):
        self.cfg, self.spec, self.weights, self.experts = cfg, spec, weights, experts
        self.rope = Rope(cfg.rope_dims, cfg.rope_theta, spec.rope_interleaved, cfg.rope_scaling,
                         device=weights.token_embedding.device)
        self.scale = softmax_scale(cfg.head_dim)
        self.dtype = weights.token_embedding.dtype

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        return {"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.value_head_dim)}

    @torch.inference_mode()
    def forward(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Float32 logits [len(batch.logits_rows), vocab]."""
        w, eps = self.weights, self.cfg.norm_eps
        # The residual stream stays float32 whatever the weights' dtype: in bfloat16 its rounding
        # is what flips near-tied routing decisions.
        x = w.token_embedding[batch.token_ids].float()
        for i, layer in enumerate(w.layers):
            x = x + self._attention(i, layer.attn, rms_norm(x, layer.attn_norm, eps).to(self.dtype), batch, kv)
            x = x + self._ffn(i, layer, rms_norm(x, layer.ffn_norm, eps))
        x = rms_norm(x[batch.logits_rows], w.output_norm, eps).to(self.dtype)
        return linear(x, w.output).float()

    def _attention(self, i: int, w: AttentionWeights, h: torch.Tensor, batch: StepBatch,
                   kv: KVCache) -> torch.Tensor:
        c, eps = self.cfg, self.cfg.norm_eps
        q, k, v = linear(h, w.q, w.q_bias), linear(h, w.k, w.k_bias), linear(h, w.v, w.v_bias)
        if self.spec.qk_norm == QK_NORM_FULL:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.value_head_dim)
        if self.spec.qk_norm == QK_NORM_PER_HEAD:
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k = self.rope(q, batch.positions), self.rope(k, batch.positions)
        kv.write(i, batch.new_slots, k=k, v=v)
        out = torch.empty(q.shape[0], c.num_heads, c.value_head_dim, dtype=q.dtype, device=q.device)
        for s in batch.seqs:
            ctx = kv.read(i, s.context_slots)
            out[s.start : s.end] = attention(q[s.start : s.end], ctx["k"], ctx["v"],
                                             batch.positions[s.start : s.end], self.scale)
        return linear(out.flatten(1), w.out)

    def _ffn(self, i: int, layer: LayerWeights, h32: torch.Tensor) -> torch.Tensor:
        """h32: the normed input in float32; the router and gates read it before rounding."""
        h = h32.to(self.dtype)
        if layer.moe is None:
            f = layer.dense_ffn
            return swiglu(h, f.gate, f.up, f.down)
        w, c = layer.moe, self.cfg
        ids, weights = route(linear(h32, w.router), c.num_experts_used, c.expert_gating,
                             c.expert_weights_norm, c.expert_weights_scale)
        out = self.experts.forward(i, h, ids, weights).float()
        if w.shared is not None:
            shared = swiglu(h, w.shared.gate, w.shared.up, w.shared.down).float()
            if w.shared_gate is not None:
                shared = shared * torch.sigmoid(linear(h32, w.shared_gate))
            out = out + shared
        return out
