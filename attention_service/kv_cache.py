"""The paged KV cache: fixed-size pools of per-token entries, addressed by slot.

A slot is `block * kv_block_tokens + offset`. Which blocks a sequence owns is the block manager's
business; this class only stores and gathers. Entries are named per architecture (`k`/`v` for
multi-head attention; MLA stores its compressed latent instead), so the cache never assumes a
layout.
"""
from __future__ import annotations

from typing import Mapping

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, kv_block_tokens: int,
                 entry_shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        self.num_blocks = num_blocks
        self.kv_block_tokens = kv_block_tokens
        num_slots = num_blocks * kv_block_tokens
        self._pools = [
            {name: torch.zeros((num_slots, *shape), dtype=dtype, device=device) for name, shape in entry_shapes.items()}
            for _ in range(num_layers)
        ]
        self.bytes_per_token = sum(
            torch.Size(shape).numel() * dtype.itemsize for shape in entry_shapes.values()) * num_layers

    def write(self, layer: int, slots: torch.Tensor, **entries: torch.Tensor) -> None:
        pool = self._pools[layer]
        for name, value in entries.items():
            pool[name].index_copy_(0, slots, value.to(pool[name].dtype))

    def read(self, layer: int, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: t.index_select(0, slots) for name, t in self._pools[layer].items()}
