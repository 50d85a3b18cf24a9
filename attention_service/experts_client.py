"""Where the attention side sends each MoE layer's routed tokens: the transport seam.

Every backend computes `kernels.moe`'s interface for one layer; the in-process one runs the
shard here, the remote ones (later) ship the same tensors to expert services and sum the parts.
"""
from __future__ import annotations

from typing import Protocol

import torch

from modelfile.experts import ExpertShard
from modelfile.gguf_file import GGUFFile


class ExpertBackend(Protocol):
    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D], expert_ids [T, K], expert_weights [T, K] -> summed expert output [T, D]."""
        ...


class InProcessExperts:
    """All routed experts of the file, computed in this process."""

    def __init__(self, g: GGUFFile):
        self.shard = ExpertShard(g)

    def forward(self, layer: int, hidden: torch.Tensor, expert_ids: torch.Tensor,
                expert_weights: torch.Tensor) -> torch.Tensor:
        out = self.shard.forward(layer, hidden.cpu(), expert_ids.cpu(), expert_weights.cpu())
        return out.to(hidden.device)
