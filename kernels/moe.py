"""The routed-expert FFN: the one interface every expert backend computes.

    hidden [T, D], expert_ids [T, K], expert_weights [T, K]  ->  out [T, D]
    out[t] = sum_k expert_weights[t, k] * FFN_{expert_ids[t, k]}(hidden[t])

Tokens are grouped by expert so each active expert's weights are touched once per call. This is
the reference path: dequantize the active experts, matmul in float32. An expert id that the given
`experts` mapping does not hold contributes nothing, so a shard computes its part of the sum and
the caller adds the parts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from kernels.quants import QuantTensor, dequantize


@dataclass(frozen=True)
class ExpertFFN:
    """One expert's SwiGLU FFN, still quantized: gate, up [ffn, D]; down [D, ffn]."""

    gate: QuantTensor
    up: QuantTensor
    down: QuantTensor

    @property
    def num_bytes(self) -> int:
        return self.gate.num_bytes + self.up.num_bytes + self.down.num_bytes


def group_by_expert(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(experts present, their slot counts, slot order): slots of expert e are contiguous in order.

    A slot is one (token, k) pair of the flattened [T, K] routing.
    """
    flat = expert_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    present, counts = torch.unique_consecutive(flat[order], return_counts=True)
    return present, counts, order


def moe_forward(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    experts: Mapping[int, ExpertFFN],
) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs, in float32, returned in `hidden.dtype`."""
    num_tokens, top_k = expert_ids.shape
    x = hidden.float()
    out = torch.zeros_like(x)
    present, counts, order = group_by_expert(expert_ids)
    token_of_slot = order // top_k
    slot_weights = expert_weights.reshape(-1).float()[order]
    start = 0
    for expert, count in zip(present.tolist(), counts.tolist()):
        end = start + count
        ffn = experts.get(expert)
        if ffn is not None:
            tokens = token_of_slot[start:end]
            y = _swiglu(x[tokens], ffn) * slot_weights[start:end, None]
            out.index_add_(0, tokens, y)
        start = end
    return out.to(hidden.dtype)


def _swiglu(x: torch.Tensor, ffn: ExpertFFN) -> torch.Tensor:
    gate = x @ dequantize(ffn.gate).T
    up = x @ dequantize(ffn.up).T
    return (F.silu(gate) * up) @ dequantize(ffn.down).T
