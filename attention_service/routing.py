"""The router: which experts each token goes to, and with what weights."""
from __future__ import annotations

import torch

from modelfile.hparams import GATING_SIGMOID


def route(router_logits: torch.Tensor, top_k: int, gating: str, renormalize: bool,
          scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts: ids [T, K] and float32 weights [T, K]."""
    logits = router_logits.float()
    probs = torch.sigmoid(logits) if gating == GATING_SIGMOID else torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * scale
