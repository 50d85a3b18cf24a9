"""A trainable qwen3moe in plain torch, written to compute what the attention and expert services compute.

Same layer order, q/k per-head RMSNorm, NeoX RoPE, grouped-query attention, a softmax router whose
top-k weights are renormalised (qwen3moe's `expert_weights_norm`) and SiLU-gated experts; its
parameters are named after and shaped like the GGUF tensors they become (`gguf_tensors`). Training
runs each expert on the rows routed to it, as the expert services do.

Shape legend: B batch, T tokens, D hidden, H query heads, G kv heads, Dh head dim, E experts, F expert ffn.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class NetShape:
    vocab_size: int
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_used: int = 2
    expert_ffn: int = 128
    rope_theta: float = 10_000.0
    rms_eps: float = 1e-6


class Block(nn.Module):
    def __init__(self, s: NetShape):
        super().__init__()
        d, hd, e, f = s.hidden_size, s.head_dim, s.num_experts, s.expert_ffn
        self.s = s
        self.attn_norm = nn.Parameter(torch.ones(d))
        self.attn_q = nn.Linear(d, s.num_heads * hd, bias=False)
        self.attn_k = nn.Linear(d, s.num_kv_heads * hd, bias=False)
        self.attn_v = nn.Linear(d, s.num_kv_heads * hd, bias=False)
        self.attn_q_norm = nn.Parameter(torch.ones(hd))
        self.attn_k_norm = nn.Parameter(torch.ones(hd))
        self.attn_output = nn.Linear(s.num_heads * hd, d, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(d))
        self.ffn_gate_inp = nn.Linear(d, e, bias=False)
        self.ffn_gate_exps = nn.Parameter(torch.randn(e, f, d) / d ** 0.5)
        self.ffn_up_exps = nn.Parameter(torch.randn(e, f, d) / d ** 0.5)
        self.ffn_down_exps = nn.Parameter(torch.randn(e, d, f) / f ** 0.5 / (2 * s.num_layers) ** 0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(F.rms_norm(x, x.shape[-1:], self.attn_norm, self.s.rms_eps), cos, sin)
        moe, balance = self.moe(F.rms_norm(x, x.shape[-1:], self.ffn_norm, self.s.rms_eps))
        return x + moe, balance

    def attention(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, (b, t, _) = self.s, h.shape
        q = self.attn_q(h).view(b, t, s.num_heads, s.head_dim)
        k = self.attn_k(h).view(b, t, s.num_kv_heads, s.head_dim)
        v = self.attn_v(h).view(b, t, s.num_kv_heads, s.head_dim)
        q = rope(F.rms_norm(q, (s.head_dim,), self.attn_q_norm, s.rms_eps), cos, sin)
        k = rope(F.rms_norm(k, (s.head_dim,), self.attn_k_norm, s.rms_eps), cos, sin)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=True)  # [B, H, T, Dh]
        return self.attn_output(out.transpose(1, 2).reshape(b, t, -1))

    def moe(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' sum, and the Switch Transformer's load-balancing term (1 when even)."""
        s, flat = self.s, h.flatten(0, 1)  # [N, D]
        probs = self.ffn_gate_inp(flat).softmax(-1)  # [N, E]
        top, ids = probs.topk(s.num_experts_used, dim=-1)  # [N, K]
        weights = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(s.num_experts):  # each expert on its own rows: a quarter of computing them all
            rows, slot = (ids == e).nonzero(as_tuple=True)
            x = flat[rows]
            y = F.linear(F.silu(F.linear(x, self.ffn_gate_exps[e])) * F.linear(x, self.ffn_up_exps[e]),
                         self.ffn_down_exps[e])
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        chosen = torch.zeros_like(probs).scatter(-1, ids, 1.0).mean(0) / s.num_experts_used
        balance = s.num_experts * (chosen * probs.mean(0)).sum()
        return out.view_as(h), balance


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotary embedding (pairs i and i + Dh/2), as llama.cpp applies to qwen files. x [B, T, H, Dh]."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class TinyQwen3Moe(nn.Module):
    def __init__(self, s: NetShape, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.s = s
        self.token_embd = nn.Embedding(s.vocab_size, s.hidden_size)
        nn.init.normal_(self.token_embd.weight, std=0.5)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.num_layers))
        self.output_norm = nn.Parameter(torch.ones(s.hidden_size))
        self.output = nn.Linear(s.hidden_size, s.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, V] and the mean load-balancing term over layers."""
        cos, sin = self.rope_tables(ids.shape[1])
        x, balance = self.token_embd(ids), 0.0
        for block in self.blocks:
            x, b = block(x, cos, sin)
            balance = balance + b
        x = F.rms_norm(x, x.shape[-1:], self.output_norm, self.s.rms_eps)
        return self.output(x), balance / len(self.blocks)

    def rope_tables(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.s.head_dim // 2
        inv_freq = 1.0 / self.s.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)
        angles = (torch.arange(num_tokens, dtype=torch.float64)[:, None] * inv_freq).float()
        return angles.cos()[:, None, :], angles.sin()[:, None, :]  # [T, 1, Dh/2]

    def gguf_tensors(self):
        """(GGUF tensor name, float32 array) in llama.cpp's order; an [out, in] weight is a
        ne = [in, out] GGUF tensor, the expert stacks [E, F, D] are ne = [D, F, E]."""
        def arr(t: torch.Tensor) -> np.ndarray:
            return t.detach().float().contiguous().numpy()

        yield "token_embd.weight", arr(self.token_embd.weight)
        for i, b in enumerate(self.blocks):
            for name in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                         "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
                p = getattr(b, name)
                yield f"blk.{i}.{name}.weight", arr(p.weight if isinstance(p, nn.Linear) else p)
        yield "output_norm.weight", arr(self.output_norm)
        yield "output.weight", arr(self.output.weight)
