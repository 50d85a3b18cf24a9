"""The shared numeric layers every architecture is wired from. Tensors in, tensors out.

Shape legend: T tokens in the step, H query heads, G kv heads, D head dim, C context tokens,
E experts, K experts per token.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from splitmoe.kernels.linear import QuantLinear, linear  # noqa: F401 - re-exported: the one linear every layer uses
from splitmoe.kernels.linear import native as native_kernels
from splitmoe.modelfile.hparams import NORM_LAYER, NORM_RMS, RopeScaling

# From this many values on (a prompt's rows), float32 norms and rotary embeddings go to the native routines
# (kernels/csrc/norm.cpp, rope.cpp): torch's norm took ~0.55 ms for 512 x 2048 and ~1 ms for a per-head
# q norm of 512 x 32 x 128, its rope ~0.85 ms for a layer's q and k (2 Zen 5 cores).
NATIVE_ROWS_MIN_VALUES = 1 << 15


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x · rsqrt(mean(x²) + eps) · weight, computed in float32, returned in x's dtype.

    torch's rms_norm is one call for the same float32 operations in the same order (bit-identical
    results), where the spelled-out form is eight: on a decode step the calls are the cost. A prompt's
    float32 rows (NATIVE_ROWS_MIN_VALUES and more) take the native routine instead, the sum of squares
    in double, as the native decode front norms.
    """
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        if x.numel() >= NATIVE_ROWS_MIN_VALUES and x.device.type == "cpu" and x.stride(-1) == 1 and x.dim() <= 3:
            nat = native_kernels()
            if nat is not None:
                return nat.rms_norm(x, weight.contiguous(), eps)
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with a weight and no bias (DBRX), computed in float32, returned in x's dtype."""
    return F.layer_norm(x.float(), weight.shape, weight.float(), None, eps).to(x.dtype)


# The norm function of each ModelConfig.norm.
NORMS = {NORM_RMS: rms_norm, NORM_LAYER: layer_norm}


class Rope:
    """Rotary position embedding over the first `dims` of each head.

    `interleaved` rotates pairs (2i, 2i+1) (llama.cpp's "norm" rope: Llama/Mixtral files, whose q/k
    rows the converter permuted); otherwise pairs (i, i + dims/2) (NeoX: Qwen, OLMoE, gpt-oss).
    `magnitude`, when given, replaces the cos/sin magnitude the scaling implies (DeepSeek's YaRN
    moves it into the attention scale instead). `freq_factors` [dims/2] divide the frequencies, as
    ggml's rope does with a file's `rope_freqs.weight`.
    """

    def __init__(self, dims: int, theta: float, interleaved: bool, scaling: RopeScaling | None = None,
                 device: torch.device | None = None, magnitude: float | None = None,
                 freq_factors: torch.Tensor | None = None):
        self.dims = dims
        self.interleaved = interleaved
        inv_freq = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
        if freq_factors is not None:  # a file's `rope_freqs` (llama3 scaling): pair j turns 1/factor[j] as fast
            inv_freq = inv_freq / freq_factors.to(device="cpu", dtype=torch.float64).reshape(dims // 2)
        inv_freq, self.magnitude = _apply_scaling(inv_freq, scaling, theta, dims)
        if magnitude is not None:
            self.magnitude = magnitude
        self.inv_freq = inv_freq.to(device)
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D], positions [T].

        Computed as rot·cos + swap(rot)·(∓sin), where swap exchanges each pair's two members: the
        same products and sums as (a·cos − b·sin, a·sin + b·cos), so bit-identical, in fewer calls.
        """
        cos, sin = self.tables(positions)
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 3 and x.stride(-1) == 1 \
                and x.numel() >= NATIVE_ROWS_MIN_VALUES:
            nat = native_kernels()
            if nat is not None:  # a prompt's rows: one native call, the same bits
                return nat.rope(x, cos[:, 0], sin[:, 0], self.interleaved)
        rot = x[..., : self.dims].float()
        if self.interleaved:
            swapped = rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
        else:
            a, b = rot.chunk(2, dim=-1)
            swapped = torch.cat((b, a), dim=-1)
        rotated = rot * cos
        rotated += swapped.mul_(sin)
        if self.dims == x.shape[-1]:
            return rotated.to(x.dtype)
        return torch.cat((rotated.to(x.dtype), x[..., self.dims :]), dim=-1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, dims] in the rotation's pair layout, for these positions.

        Kept for the last few positions tensors seen (held, so an id is never a recycled one's):
        every layer's q and k of a step, or of each of its micro-batches, share them. Not while a
        CUDA graph is captured: a graph must compute its tables itself, not read tensors another
        graph wrote, which the cache could free and the graph pool hand out again.
        """
        if positions.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._tables(positions)
        hit = self._cache.get(id(positions))
        if hit is not None and hit[0] is positions:
            return hit[1], hit[2]
        cos2, sin2 = self._tables(positions)
        if len(self._cache) >= 4:
            self._cache.clear()
        self._cache[id(positions)] = (positions, cos2, sin2)
        return cos2, sin2

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = angles.cos() * self.magnitude
        sin = angles.sin() * self.magnitude
        if self.interleaved:
            cos2 = cos.repeat_interleave(2, dim=-1)
            sin2 = torch.stack((-sin, sin), dim=-1).flatten(-2)
        else:
            cos2 = torch.cat((cos, cos), dim=-1)
            sin2 = torch.cat((-sin, sin), dim=-1)
        return cos2[:, None, :], sin2[:, None, :]


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


def swiglu(x: torch.Tensor, ffn, lora: tuple | None = None) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) of a dense FFN's weights (weights.DenseFFNWeights).

    `lora`: (StepLora, "blk.N.", suffix) when rows of the step use adapters: the GGUF names of the
    three products are `blk.N.ffn_gate{suffix}.weight` and so on (suffix "_shexp": a shared expert)."""
    if isinstance(ffn.gate, QuantLinear):
        x = x.float()  # what the quantized routes take: converted once for gate and up
    gate, up = ffn.gate_up(x)
    if lora is None:
        return linear(F.silu(gate) * up, ffn.down)
    step, prefix, suffix = lora
    gate, up = step.add_parts((f"{prefix}ffn_gate{suffix}.weight", f"{prefix}ffn_up{suffix}.weight"), x, (gate, up))
    a = F.silu(gate) * up
    return step.add(f"{prefix}ffn_down{suffix}.weight", a, linear(a, ffn.down))


def softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
