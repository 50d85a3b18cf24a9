"""Llama 4's iRoPE attention: multi-head attention whose layers come in two kinds.

* rope layers (all but every `nope_layer_interval`-th): rope with the file's `rope_freqs`, then
  an L2 norm (RMSNorm without weight) of each q and k head, then attention within the query's
  chunk of `attention_chunk_tokens` positions (from the chunk's start to the query);
* NoPE layers: no rope, no q/k norm, full causal attention, and q scaled by the temperature
  log(floor((pos + 1) / floor_tokens) + 1) * scale + 1, which is 1 below position floor - 1.

As llama.cpp's llama4 graph computes them, with its constants (modelfile/architectures/llama4.py).
The L2 norm is llama.cpp's too: on unless the model has 128 experts (Maverick), a rule it keys on
the expert count alone.
"""
from __future__ import annotations

import torch

from splitmoe.attention_service.model.attention import AttentionWeights, MultiHeadAttention
from splitmoe.modelfile.architectures.base import ArchSpec
from splitmoe.modelfile.hparams import ModelConfig

# llama.cpp: `use_kq_norm = type != LLM_TYPE_17B_128E`, the type read off the expert count.
_NO_QK_NORM_EXPERTS = 128


class IRopeAttention(MultiHeadAttention):
    def __init__(self, cfg: ModelConfig, spec: ArchSpec, device: torch.device, rope_freqs: torch.Tensor | None = None):
        super().__init__(cfg, spec, device, rope_freqs)
        self.l2_qk_norm = cfg.num_experts != _NO_QK_NORM_EXPERTS

    def uses_rope(self, layer: int) -> bool:
        n = self.cfg.nope_layer_interval
        return not n or (layer + 1) % n != 0

    def chunk_tokens(self, layer: int) -> int:
        return self.cfg.attention_chunk_tokens if self.uses_rope(layer) else 0

    def native_front(self, *args: object, **kwargs: object) -> None:
        """No native front: its kernel knows neither NoPE layers, the L2 norm nor the temperature."""
        return None

    def _position(self, i: int, w: AttentionWeights, q: torch.Tensor, k: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.uses_rope(i):
            return self._tempered(q, positions), k
        q, k = self.rope(q, positions), self.rope(k, positions)
        if self.l2_qk_norm:
            q, k = l2_norm(q, self.cfg.norm_eps), l2_norm(k, self.cfg.norm_eps)
        return q, k

    def _tempered(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        if not c.attention_temperature_floor_tokens:
            return q
        steps = torch.floor((positions.to(torch.float32) + 1.0) / c.attention_temperature_floor_tokens)
        factor = torch.log(steps + 1.0) * c.attention_temperature_scale + 1.0
        return (q.float() * factor[:, None, None]).to(q.dtype)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) over the last dim, in float32 (Llama4TextL2Norm, ggml_rms_norm)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
