"""Reads one named tensor of the GGUF file onto the attention device: dense, or kept quantized.

Float32 mode (and any non-CPU device) dequantizes every weight at load, exactly. The fast mode,
bfloat16 on the CPU, keeps each block-quantized linear weight and the token embedding as the
file's blocks (kernels/linear.py) and dequantizes the rest (F32/F16/BF16 tensors, MLA's per-head
maps) to bfloat16 as before. Norms, router, biases the caller asks float32 for stay float32.

Every read names the shape the hyper-parameters give the tensor, checked before anything is
copied (GGUFFile.tensor): a file whose tensors disagree with its metadata fails at load, never
at the first request. The loader also remembers what it read, so that the model can refuse
tensors nothing reads (a renamed `output.weight` must not pass as a tied embedding).
"""
from __future__ import annotations

import itertools
from typing import Sequence

import torch

from splitmoe.kernels.linear import QuantEmbedding, QuantHeads, QuantLinear, is_block_quantized
from splitmoe.kernels.quants import QuantTensor, dequantize
from splitmoe.modelfile.gguf_file import GGUFFile

Shape = tuple[int, ...]


def is_attention_projection(name: str) -> bool:
    """GGUF's attention projections (blk.N.attn_q / _k / _v / _qkv / _output, MLA's attn_q_a / _q_b /
    _kv_a_mqa / _kv_b, and views of them): in a step of one sequence their rows take the int8 kernel in two
    terms (kernels/linear.py `single_sequence_step`). On the
    fixtures (bfloat16, one token a step, teacher-forced; tests/attention_service/model/test_decode_fidelity.py)
    the decode path moved 17 positions over the sixteen files with one term, llama4 q8_0 and dbrx q4_k_m
    more than llama.cpp (17 in all), and 4 with two."""
    return ".attn_" in name


def quantized_mode(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linear weights stay quantized: the bfloat16 ("fast") mode on the CPU."""
    return dtype == torch.bfloat16 and torch.device(device).type == "cpu"


class WeightLoader:
    def __init__(self, g: GGUFFile, dtype: torch.dtype, device: torch.device, quantized: bool | None = None):
        self.g, self.dtype, self.device = g, dtype, device
        self.quantized = quantized_mode(dtype, device) if quantized is None else quantized
        self.used: set[str] = set()  # every tensor read so far

    def tensor(self, name: str, shape: Shape) -> QuantTensor:
        qt = self.g.tensor(name, shape)
        self.used.add(name)
        return qt

    def __call__(self, name: str, shape: Shape, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._dense(self.tensor(name, shape), dtype)

    def optional(self, name: str, shape: Shape, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return self(name, shape, dtype) if self.g.has(name) else None

    def norm(self, name: str, shape: Shape) -> torch.Tensor:
        return self(name, shape, torch.float32)

    def linear(self, name: str, shape: Shape) -> torch.Tensor | QuantLinear:
        """A weight used as x @ W.T: a QuantLinear in the fast mode when its type is block-quantized."""
        return self._linear(self.tensor(name, shape))

    def linear_parts(self, name: str, rows: Sequence[int], in_features: int) -> list[torch.Tensor | QuantLinear]:
        """Linears stored stacked by rows in one tensor (DBRX's `attn_qkv`: q | k | v), one per `rows`
        count. Quant blocks never cross a row, so each part is a view of the file's rows."""
        qt = self.tensor(name, (sum(rows), in_features))
        edges = list(itertools.accumulate(rows, initial=0))
        return [self._linear(QuantTensor(f"{name}[{a}:{b}]", qt.ggml_type, (b - a, in_features), qt.data[a:b]))
                for a, b in zip(edges, edges[1:])]

    def _linear(self, qt: QuantTensor) -> torch.Tensor | QuantLinear:
        if self.quantized and len(qt.shape) == 2 and is_block_quantized(qt.ggml_type):
            return QuantLinear(qt, self.dtype, residual=is_attention_projection(qt.name))
        return self._dense(qt)

    def heads(self, name: str, shape: Shape) -> torch.Tensor | QuantHeads:
        """Per-head maps [H, rows, k]: a QuantHeads in the fast mode when block-quantized."""
        qt = self.tensor(name, shape)
        if self.quantized and is_block_quantized(qt.ggml_type):
            return QuantHeads(qt, self.dtype)
        return self._dense(qt)

    def linear_optional(self, name: str, shape: Shape) -> torch.Tensor | QuantLinear | None:
        return self.linear(name, shape) if self.g.has(name) else None

    def embedding(self, name: str, shape: Shape) -> torch.Tensor | QuantEmbedding:
        qt = self.tensor(name, shape)
        if self.quantized and len(qt.shape) == 2 and is_block_quantized(qt.ggml_type):
            return QuantEmbedding(qt, self.dtype)
        return self._dense(qt)

    def _dense(self, qt: QuantTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(qt).to(device=self.device, dtype=dtype or self.dtype)
