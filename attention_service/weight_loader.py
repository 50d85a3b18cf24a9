"""Reads one named tensor of the GGUF file onto the attention device: dense, or kept quantized.

Float32 mode (and any non-CPU device) dequantizes every weight at load, exactly. The fast mode,
bfloat16 on the CPU, keeps each block-quantized linear weight and the token embedding as the
file's blocks (kernels/linear.py) and dequantizes the rest (F32/F16/BF16 tensors, MLA's per-head
maps) to bfloat16 as before. Norms, router, biases the caller asks float32 for stay float32.
"""
from __future__ import annotations

import torch

from kernels.linear import QuantEmbedding, QuantLinear, is_block_quantized
from kernels.quants import dequantize
from modelfile.gguf_file import GGUFFile


def quantized_mode(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear weights stay quantized: the bfloat16 ("fast") mode on the CPU."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu"


class WeightLoader:
    def __init__(self, g: GGUFFile, dtype: torch.dtype, device: torch.device, quantized: bool | None = None):
        self.g, self.dtype, self.device = g, dtype, device
        self.quantized = quantized_mode(dtype, device) if quantized is None else quantized

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.g.tensor(name)).to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self(name, dtype) if self.g.has(name) else None

    def norm(self, name: str) -> torch.Tensor:
        return self(name, torch.float32)

    def linear(self, name: str) -> torch.Tensor | QuantLinear:
        """A weight used as x @ W.T: a QuantLinear in the fast mode when its type is block-quantized."""
        qt = self.g.tensor(name)
        if self.quantized and len(qt.shape) == 2 and is_block_quantized(qt.ggml_type):
            return QuantLinear(qt, self.dtype)
        return self(name)

    def linear_optional(self, name: str) -> torch.Tensor | QuantLinear | None:
        return self.linear(name) if self.g.has(name) else None

    def embedding(self, name: str) -> torch.Tensor | QuantEmbedding:
        qt = self.g.tensor(name)
        if self.quantized and len(qt.shape) == 2 and is_block_quantized(qt.ggml_type):
            return QuantEmbedding(qt, self.dtype)
        return self(name)
