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
        # Per sequence, the slots of all its blocks' tokens, rebuilt only when it gains blocks:
        # a decode step then costs a slice, not a tensor built from the whole table.
        self._slots: dict[int, torch.Tensor] = {}

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
        """Cache slots of token positions [start, end) of the sequence (a read-only view)."""
        table = self._tables[seq_id]
        cached = self._slots.get(seq_id)
        if cached is None or cached.numel() != len(table) * self.kv_block_tokens:
            blocks = torch.tensor(table, dtype=torch.long)
            cached = (blocks[:, None] * self.kv_block_tokens + torch.arange(self.kv_block_tokens)).reshape(-1)
            self._slots[seq_id] = cached
        if not 0 <= start <= end <= cached.numel():
            raise IndexError(f"sequence {seq_id}: positions {start}..{end} beyond its {cached.numel()} "
                             "reserved slots")
        return cached[start:end]

    def free(self, seq_id: int) -> None:
        self._slots.pop(seq_id, None)
        self._free.extend(reversed(self._tables.pop(seq_id, [])))
