"""Multi-head attention with grouped KV heads over the paged cache (Qwen, Mixtral, OLMoE).

An architecture names its attention class in its ArchSpec; each class loads its own weights,
declares its KV cache entries and computes one layer. MLA (DeepSeek) is another such class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attention_service.batch import StepBatch
from attention_service.kv_cache import KVCache
from attention_service.layers import Rope, linear, rms_norm, softmax_scale
from attention_service.weight_loader import WeightLoader
from modelfile.hparams import ModelConfig

if TYPE_CHECKING:
    from attention_service.models.base import ArchSpec

QK_NORM_NONE, QK_NORM_PER_HEAD, QK_NORM_FULL = "none", "per_head", "full"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Causal attention of new queries over the whole context, computed in float32.

    q [T, H, D] at absolute `q_positions` [T]; k [C, G, D] and v [C, G, Dv] hold positions 0..C-1.
    Returns [T, H, Dv] in q's dtype.
    """
    context = torch.arange(k.shape[0], device=k.device)
    allowed = context[None, :] <= q_positions[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1),
        attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(0, 1).to(q.dtype)


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


class MultiHeadAttention:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, device: torch.device):
        self.cfg, self.spec = cfg, spec
        self.rope = Rope(cfg.rope_dims, cfg.rope_theta, spec.rope_interleaved, cfg.rope_scaling, device=device)
        self.scale = softmax_scale(cfg.head_dim)

    @staticmethod
    def load_weights(load: WeightLoader, spec: ArchSpec, p: str) -> AttentionWeights:
        bias = load if spec.qkv_bias else load.optional
        has_norm = spec.qk_norm != QK_NORM_NONE
        return AttentionWeights(
            q=load(p + "attn_q.weight"), k=load(p + "attn_k.weight"), v=load(p + "attn_v.weight"),
            out=load(p + "attn_output.weight"),
            q_bias=bias(p + "attn_q.bias"), k_bias=bias(p + "attn_k.bias"), v_bias=bias(p + "attn_v.bias"),
            q_norm=load.norm(p + "attn_q_norm.weight") if has_norm else None,
            k_norm=load.norm(p + "attn_k_norm.weight") if has_norm else None,
        )

    def kv_entry_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.cfg
        return {"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.value_head_dim)}

    def __call__(self, i: int, w: AttentionWeights, h: torch.Tensor, batch: StepBatch,
                 kv: KVCache) -> torch.Tensor:
        """h [T, hidden] -> attention output [T, hidden]; writes this step's K/V to the cache."""
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
