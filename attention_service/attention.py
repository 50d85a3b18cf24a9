"""Multi-head attention with grouped KV heads over the paged cache (Qwen, Mixtral, OLMoE, gpt-oss).

An architecture names its attention class in its ArchSpec; each class loads its own weights,
declares its KV cache entries and computes one layer. MLA (DeepSeek) is another such class.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from attention_service.batch import SeqSlice, StepBatch
from attention_service.kv_cache import KVCache
from attention_service.layers import Rope, linear, rms_norm, softmax_scale
from attention_service.weight_loader import WeightLoader
from modelfile.hparams import ModelConfig

if TYPE_CHECKING:
    from attention_service.models.base import ArchSpec

QK_NORM_NONE, QK_NORM_PER_HEAD, QK_NORM_FULL = "none", "per_head", "full"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor,
              scale: float, *, window_tokens: int = 0, sinks: torch.Tensor | None = None,
              first_position: int = 0) -> torch.Tensor:
    """Causal attention of new queries over the context, computed in float32.

    q [T, H, D] at absolute `q_positions` [T]; k [C, G, D] and v [C, G, Dv] hold positions
    `first_position`..`first_position`+C-1. `window_tokens` > 0: each query sees only itself and
    the window_tokens-1 positions before it (sliding window). `sinks` [H]: one learned logit per
    head that joins the softmax denominator and adds no value (gpt-oss).
    Returns [T, H, Dv] in q's dtype.
    """
    context = torch.arange(first_position, first_position + k.shape[0], device=k.device)
    allowed = context[None, :] <= q_positions[:, None]
    if window_tokens:
        allowed &= context[None, :] > q_positions[:, None] - window_tokens
    qf, kf, vf = q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
    if sinks is None:
        out = F.scaled_dot_product_attention(qf, kf, vf, attn_mask=allowed, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    else:
        out = _attention_with_sinks(qf, kf, vf, allowed, scale, sinks)
    return out.transpose(0, 1).to(q.dtype)


def _attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
                          scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """q [H, T, D], k [G, C, D], v [G, C, Dv] in float32 -> [H, T, Dv].

    Written out because SDPA has no sink term: softmax over [scores, sink], then the sink's
    column is dropped, so a head can put weight on "nothing" instead of on some token.
    """
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~allowed, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[1], 1)
    probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return probs @ v


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
    out_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [H] float32 (gpt-oss)


class MultiHeadAttention:
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, device: torch.device):
        self.cfg, self.spec = cfg, spec
        self.rope = Rope(cfg.rope_dims, cfg.rope_theta, spec.rope_interleaved, cfg.rope_scaling, device=device)
        self.scale = softmax_scale(cfg.head_dim)
        if spec.sliding_window_pattern and cfg.sliding_window_tokens <= 0:
            raise ValueError(f"{cfg.arch}: sliding-window layers need {cfg.arch}.attention.sliding_window > 0")

    def window_tokens(self, layer: int) -> int:
        """The layer's sliding window, 0 for full attention.

        As llama.cpp's swa pattern: in each group of `sliding_window_pattern` layers all but the
        last slide (gpt-oss, pattern 2: even layers slide, as its config's layer_types say).
        """
        n = self.spec.sliding_window_pattern
        return self.cfg.sliding_window_tokens if n and layer % n < n - 1 else 0

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
            out_bias=load.optional(p + "attn_output.bias"),
            sinks=load.norm(p + "attn_sinks.weight") if spec.attention_sinks else None,
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
        window = self.window_tokens(i)
        for s in batch.seqs:
            first = _first_visible_position(s, window)
            ctx = kv.read(i, s.context_slots[first:])
            out[s.start : s.end] = attention(q[s.start : s.end], ctx["k"], ctx["v"],
                                             batch.positions[s.start : s.end], self.scale,
                                             window_tokens=window, sinks=w.sinks, first_position=first)
        return linear(out.flatten(1), w.out, w.out_bias)


def _first_visible_position(s: SeqSlice, window_tokens: int) -> int:
    """The oldest context position any of the slice's queries sees: a sliding layer reads no more.

    The context holds positions 0..C-1 with the slice's new tokens last (host-side ints, no sync).
    """
    if not window_tokens:
        return 0
    first_query = len(s.context_slots) - (s.end - s.start)
    return max(0, first_query - window_tokens + 1)
