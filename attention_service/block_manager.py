"""Which KV blocks each sequence owns. Counts only: no tensors are touched here."""
from __future__ import annotations

import torch


class KVCacheFull(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, kv_block_tokens: int):
        self.kv_block_tokens = kv_block_tokens
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.kv_block_tokens) - have)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make room for the sequence's first `num_tokens` tokens."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise KVCacheFull(f"KV cache full: sequence {seq_id} needs {need} more blocks, {len(self._free)} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self._free.pop() for _ in range(need))

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Cache slots of token positions [start, end) of the sequence."""
        table = torch.tensor(self._tables[seq_id], dtype=torch.long)
        positions = torch.arange(start, end)
        return table[positions // self.kv_block_tokens] * self.kv_block_tokens + positions % self.kv_block_tokens

    def free(self, seq_id: int) -> None:
        self._free.extend(reversed(self._tables.pop(seq_id, [])))
