"""Decode steps of several sequences together, fed tokens by a fixed rule: two runners (paths,
devices, backends) compared on the same tokens, whatever either's logits say."""
from __future__ import annotations

import torch

from splitmoe.attention_service.model.runner import ModelRunner
from splitmoe.attention_service.model.sequence import Sequence


def decode_steps(runner: ModelRunner, prompts: list[list[int]], num_steps: int) -> torch.Tensor:
    """Every decode step's logits [steps, sequences, vocab] on the CPU: the prompts prefilled in one
    step, then `num_steps` steps of one new token each."""
    seqs = [Sequence(i, list(p)) for i, p in enumerate(prompts)]
    runner.step(seqs)
    out = []
    for t in range(num_steps):
        for s in seqs:
            s.token_ids.append((s.token_ids[-1] * 7 + t) % 200 + 3)
        out.append(runner.step(seqs))
    return torch.stack(out).cpu()
