"""Reads one named tensor of the GGUF file, dequantized onto the attention device."""
from __future__ import annotations

import torch

from kernels.quants import dequantize
from modelfile.gguf_file import GGUFFile


class WeightLoader:
    def __init__(self, g: GGUFFile, dtype: torch.dtype, device: torch.device):
        self.g, self.dtype, self.device = g, dtype, device

    def __call__(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.g.tensor(name)).to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self(name, dtype) if self.g.has(name) else None

    def norm(self, name: str) -> torch.Tensor:
        return self(name, torch.float32)
