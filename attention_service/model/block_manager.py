"""Which KV blocks each sequence owns. Counts only: no tensors are touched here.

With prefix caching, a sequence's full blocks are named once their tokens are computed (`commit`)
and a new sequence starts from the longest run of named blocks matching its tokens
(`cached_prefix`, then `take`), skipping their prefill. Shared blocks are always full and before the
sequence's first uncomputed token, so no sequence ever writes into a block another one reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from splitmoe.attention_service.model.block_pool import ROOT_HASH, BlockPool, hash_block_tokens
from splitmoe.attention_service.model.sequence import Sequence


class KVCacheFull(RuntimeError):
    pass


@dataclass
class PrefixCacheStats:
    """Tokens, as vLLM's prefix_cache_queries / prefix_cache_hits: the hit rate is hits / queries."""

    queries: int = 0  # tokens of the requests admitted (their whole sequence, each admission)
    hits: int = 0  # of those, tokens taken from the cache instead of computed

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks that continue a sequence's table, with their names."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, kv_block_tokens: int, prefix_caching: bool = False):
        self.kv_block_tokens = kv_block_tokens
        self.prefix_caching = prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._tables: dict[int, list[int]] = {}
        # Per sequence, the names of its first full blocks that are computed (or were taken from
        # the cache): the chain the next block's name continues.
        self._hashes: dict[int, list[bytes]] = {}
        # Per sequence, the slots of all its blocks' tokens, rebuilt only when it gains blocks:
        # a decode step then costs a slice, not a tensor built from the whole table.
        self._slots: dict[int, torch.Tensor] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.kv_block_tokens) - have)

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make room for the sequence's first `num_tokens` tokens."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.pool.num_free:
            raise KVCacheFull(f"KV cache full: sequence {seq_id} needs {need} more blocks, {self.pool.num_free} free")
        table = self._tables.setdefault(seq_id, [])
        table.extend(self.pool.allocate() for _ in range(need))

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
        self._hashes.pop(seq_id, None)
        self.pool.release(self._tables.pop(seq_id, []))

    # ---- prefix caching -------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> PrefixHit:
        """The cached blocks that would continue the sequence from its computed tokens, stopping at
        the first miss and before its last token's block (the last token is always computed, so
        that its logits exist). Nothing unless its computed tokens end on a block boundary with
        no block reserved past them: at admission, or between whole-block prefill chunks."""
        B = self.kv_block_tokens
        table = self._tables.get(seq.seq_id, [])
        start = len(table)
        chain = self._hashes.get(seq.seq_id, [ROOT_HASH])
        if not self.prefix_caching or seq.num_cached_tokens != start * B or len(chain) - 1 != start:
            return PrefixHit()
        parent = chain[-1]
        blocks, hashes = [], []
        for i in range(start, (seq.num_tokens - 1) // B):
            parent = hash_block_tokens(parent, seq.token_ids[i * B:(i + 1) * B], _extra_keys(seq))
            block = self.pool.lookup(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        return PrefixHit(tuple(blocks), tuple(hashes))

    def blocks_to_take(self, seq: Sequence, hit: PrefixHit, num_tokens: int) -> int:
        """Free blocks that taking `hit` and then reserving the first `num_tokens` tokens uses up:
        the new blocks, and the hit's blocks that nobody holds (reviving one takes it off the queue)."""
        revived = sum(self.pool.is_free(b) for b in hit.blocks)
        return revived + max(0, self.blocks_needed(seq.seq_id, num_tokens) - len(hit.blocks))

    def take(self, seq: Sequence, hit: PrefixHit, admitted: bool) -> None:
        """Start the sequence's next blocks from `hit`: their tokens count as computed.
        `admitted`: the sequence is being admitted, so its tokens count as queried."""
        if admitted and self.prefix_caching:
            self.prefix_stats.queries += seq.num_tokens
        if not hit.blocks:
            return
        for block in hit.blocks:
            self.pool.acquire(block)
        self._tables.setdefault(seq.seq_id, []).extend(hit.blocks)
        self._hashes.setdefault(seq.seq_id, [ROOT_HASH]).extend(hit.hashes)
        num_tokens = len(hit.blocks) * self.kv_block_tokens
        seq.num_cached_tokens += num_tokens
        self.prefix_stats.hits += num_tokens

    def commit(self, seq: Sequence) -> None:
        """Name the sequence's blocks its computed tokens have filled since the last call."""
        if not self.prefix_caching:
            return
        B = self.kv_block_tokens
        chain = self._hashes.setdefault(seq.seq_id, [ROOT_HASH])
        table = self._tables[seq.seq_id]
        for i in range(len(chain) - 1, seq.num_cached_tokens // B):
            chain.append(hash_block_tokens(chain[-1], seq.token_ids[i * B:(i + 1) * B], _extra_keys(seq)))
            self.pool.name(table[i], chain[-1])


def _extra_keys(seq: Sequence) -> tuple[int, ...]:
    """What besides the tokens changes a block's KV. Routed experts per token change every MoE
    layer's output and so the KV of every later layer. (0, the model's own, and that count given
    explicitly name different blocks: a lost hit, never a wrong one.) A LoRA adapter changes
    every adapted product, so its identity is part of the key too."""
    return (seq.num_experts_per_token,) if seq.lora is None else (seq.num_experts_per_token, seq.lora.key)
