"""One scheduler step's tokens, flattened across sequences, with where each one's KV lives."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's rows in the flat batch and the KV slots of its whole context so far."""

    start: int
    end: int
    context_slots: torch.Tensor  # [C], position order, the new tokens' slots last


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    new_slots: torch.Tensor  # [T]: where each new token's KV is written
    seqs: tuple[SeqSlice, ...]
    logits_rows: torch.Tensor  # rows of the batch whose logits are wanted
    experts_per_token: torch.Tensor | None = None  # [T]; None: every token uses the model's own k

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])
