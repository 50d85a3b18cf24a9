"""The router: which experts each token goes to, and with what weights."""
from __future__ import annotations

import torch

from splitmoe.modelfile.hparams import GATING_SIGMOID, GATING_SOFTMAX_WEIGHT


def route(router_logits: torch.Tensor, top_k: int, gating: str, renormalize: bool,
          scale: float = 1.0, *, selection_bias: torch.Tensor | None = None, num_groups: int = 0,
          num_groups_used: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick each token's experts: ids [T, K] and float32 weights [T, K].

    DeepSeek-V3: `selection_bias` [E] is added to the scores to choose experts but not to weight
    them, and with `num_groups` > 1 only experts of the best `num_groups_used` groups compete.
    """
    logits = router_logits.float()
    if gating == GATING_SOFTMAX_WEIGHT:
        # gpt-oss: choose by raw logit, then softmax over the chosen k (llama.cpp's SOFTMAX_WEIGHT).
        top_logits, ids = torch.topk(logits, top_k, dim=-1)
        return ids, torch.softmax(top_logits, dim=-1) * scale
    probs = torch.sigmoid(logits) if gating == GATING_SIGMOID else torch.softmax(logits, dim=-1)
    if selection_bias is None and num_groups <= 1:
        weights, ids = torch.topk(probs, top_k, dim=-1)
    else:
        ids = _biased_grouped_top_k(probs, top_k, selection_bias, num_groups, num_groups_used)
        weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * scale


def _biased_grouped_top_k(probs: torch.Tensor, top_k: int, bias: torch.Tensor | None, num_groups: int,
                          num_groups_used: int) -> torch.Tensor:
    """ids [T, K] of the top-k biased scores among the experts of each token's best groups.

    A group scores the sum of its two best biased scores, as DeepSeek-V3 and llama.cpp do (llama.cpp
    uses this for every grouped file, DeepSeek-V2's max-scored groups included).
    """
    scores = probs if bias is None else probs + bias.float()
    if 1 < num_groups and 0 < num_groups_used < num_groups:
        grouped = scores.view(scores.shape[0], num_groups, -1)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        best = group_scores.topk(num_groups_used, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        scores = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(scores)
    return torch.topk(scores, top_k, dim=-1).indices


def sums_to_one(gating: str, renormalize: bool) -> bool:
    """Whether `route`'s weights of a token sum to one (before `scale`): renormalised, or a softmax
    over the chosen k alone."""
    return renormalize or gating == GATING_SOFTMAX_WEIGHT


def limit_experts(ids: torch.Tensor, weights: torch.Tensor, experts_per_token: torch.Tensor,
                  renormalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each token's first `experts_per_token[t]` experts (ids come best first); drop the rest.

    Dropped slots get id -1, which no expert backend computes. Where the model renormalises its
    top-k weights, the kept ones are renormalised to the same total, as if k had been smaller.
    """
    keep = torch.arange(ids.shape[1], device=ids.device)[None, :] < experts_per_token[:, None]
    kept = weights * keep
    if renormalized:
        kept = kept * (weights.sum(-1, keepdim=True) / kept.sum(-1, keepdim=True))
    return ids.masked_fill(~keep, -1), kept
