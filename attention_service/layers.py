"""The shared numeric layers every architecture is wired from. Tensors in, tensors out.

Shape legend: T tokens in the step, H query heads, G kv heads, D head dim, C context tokens,
E experts, K experts per token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from modelfile.hparams import RopeScaling


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


class Rope:
    """Rotary position embedding over the first `dims` of each head.

    `interleaved` rotates pairs (2i, 2i+1) (llama.cpp's "norm" rope: Llama/Mixtral files, whose q/k
    rows the converter permuted); otherwise pairs (i, i + dims/2) (NeoX: Qwen, OLMoE, gpt-oss).
    `magnitude`, when given, replaces the cos/sin magnitude the scaling implies (DeepSeek's YaRN
    moves it into the attention scale instead).
    """

    def __init__(self, dims: int, theta: float, interleaved: bool, scaling: RopeScaling | None = None,
                 device: torch.device | None = None, magnitude: float | None = None):
        self.dims = dims
        self.interleaved = interleaved
        inv_freq = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        inv_freq, self.magnitude = _apply_scaling(inv_freq, scaling, theta, dims)
        if magnitude is not None:
            self.magnitude = magnitude
        self.inv_freq = inv_freq.to(device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D], positions [T]."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = (angles.cos() * self.magnitude)[:, None, :]
        sin = (angles.sin() * self.magnitude)[:, None, :]
        rot, rest = x[..., : self.dims].float(), x[..., self.dims :]
        if self.interleaved:
            a, b = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
        else:
            a, b = rot.chunk(2, dim=-1)
            rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
        return torch.cat((rotated.to(x.dtype), rest), dim=-1)


def _apply_scaling(inv_freq: torch.Tensor, scaling: RopeScaling | None, theta: float,
                   dims: int) -> tuple[torch.Tensor, float]:
    """(scaled inverse frequencies, cos/sin magnitude) for linear or YaRN context extension."""
    if scaling is None:
        return inv_freq.float(), 1.0
    interpolated = inv_freq / scaling.factor
    if scaling.kind == "linear":
        return interpolated.float(), 1.0
    # YaRN: high-frequency pairs keep their frequency, low ones are interpolated, with a linear
    # ramp between the pair indices where `beta_fast` and `beta_slow` rotations fit the original
    # context (as ggml_rope_yarn_corr_dims and transformers' _compute_yarn_parameters do).
    low = max(0, math.floor(_yarn_corr_dim(scaling.yarn_beta_fast, dims, theta, scaling.original_context_tokens)))
    high = min(dims - 1, math.ceil(_yarn_corr_dim(scaling.yarn_beta_slow, dims, theta, scaling.original_context_tokens)))
    pair = torch.arange(dims // 2, dtype=torch.float64)
    keep = 1.0 - ((pair - low) / max(high - low, 0.001)).clamp(0.0, 1.0)
    magnitude = 1.0 + 0.1 * math.log(scaling.factor) if scaling.factor > 1 else 1.0
    return (interpolated * (1 - keep) + inv_freq * keep).float(), magnitude


def _yarn_corr_dim(rotations: float, dims: int, theta: float, original_context_tokens: int) -> float:
    return dims * math.log(original_context_tokens / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
