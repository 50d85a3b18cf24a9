"""The routed-expert FFN: the one interface every expert backend computes.

    hidden [T, D], expert_ids [T, K], expert_weights [T, K]  ->  out [T, D]
    out[t] = sum_k expert_weights[t, k] * FFN_{expert_ids[t, k]}(hidden[t])
    FFN(x) = down @ act(gate @ x + gate_bias, up @ x + up_bias) + down_bias   (biases: gpt-oss)

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

from splitmoe.kernels.quants import QuantTensor, dequantize

# The gated activation between up/gate and down: act(gate, up) -> [n, ffn].
ACT_SILU = "silu"  # silu(gate) * up: Qwen, Mixtral, OLMoE, DeepSeek
ACT_SWIGLU_OAI = "swiglu_oai"  # gpt-oss's clamped SwiGLU (llama.cpp's swiglu_oai)
# gpt-oss fixes these in its code (transformers' swiglu_alpha/limit, llama.cpp's constants).
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class ExpertFFN:
    """One expert's gated FFN, still quantized: gate, up [ffn, D]; down [D, ffn].

    Optional float32 biases (gpt-oss): gate and up [ffn], down [D].
    """

    gate: QuantTensor
    up: QuantTensor
    down: QuantTensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: str = ACT_SILU

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {self.activation!r}: want one of {', '.join(ACTIVATIONS)}")

    @property
    def num_bytes(self) -> int:
        biases = (b for b in (self.gate_bias, self.up_bias, self.down_bias) if b is not None)
        return self.gate.num_bytes + self.up.num_bytes + self.down.num_bytes + sum(b.nbytes for b in biases)


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
            y = _expert_ffn(x[tokens], ffn) * slot_weights[start:end, None]
            out.index_add_(0, tokens, y)
        start = end
    return out.to(hidden.dtype)


def _expert_ffn(x: torch.Tensor, ffn: ExpertFFN) -> torch.Tensor:
    gate = _matmul(x, ffn.gate, ffn.gate_bias)
    up = _matmul(x, ffn.up, ffn.up_bias)
    return _matmul(ACTIVATIONS[ffn.activation](gate, up), ffn.down, ffn.down_bias)


def _matmul(x: torch.Tensor, weight: QuantTensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x @ dequantize(weight).T
    return y if bias is None else y + bias.float()


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss: gate clamped above, up clamped both ways, a sharper sigmoid, and up shifted by one."""
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


ACTIVATIONS = {ACT_SILU: silu_glu, ACT_SWIGLU_OAI: swiglu_oai}
"""act(gate, up) by name: shared by this reference and the fast path (kernels.expert_kernels)."""
