"""A sequence as the model runner sees it: its token ids and how many of them the KV cache holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitmoe.attention_service.model.lora import AdapterWeights


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_cached_tokens: int = 0  # tokens whose KV is already in the cache
    num_experts_per_token: int = 0  # routed experts per token; 0: the model's own (or the server's)
    lora: AdapterWeights | None = None  # the LoRA adapter its request names (model/lora.py); None: the base

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
