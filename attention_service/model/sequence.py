"""A sequence as the model runner sees it: its token ids and how many of them the KV cache holds."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_cached_tokens: int = 0  # tokens whose KV is already in the cache
    num_experts_per_token: int = 0  # routed experts per token; 0: the model's own (or the server's)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
