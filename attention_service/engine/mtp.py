"""`--speculative mtp`: the file's own NextN/MTP block drafts the tokens (model/nextn.py).

The block's row i reads the main model's final-normed hidden state at position i and the token at
i+1, and predicts the token at i+2; its attention reads its own KV of the rows before. So per
request the drafter keeps the main model's hidden states of the positions its block has not run
yet (the runner hands every step's rows over: `ModelRunner.hidden_sink`), and at each proposal:

1. runs the block over those rows in one pass, up to the row of the last token's predecessor,
   whose output predicts the token after the last: the first draft;
2. drafts on one row at a time, each fed the block's own output and the token it just drafted
   (llama.cpp's and vLLM's recursion with one block).

Only rows whose hidden state and next token the main model confirmed count as done: the drafted
rows' KV is overwritten at the next proposal. The rows of drafts the main model rejected never
reach the block: a step's rows at and past the sequence's new length are replaced by the next
step's. Every pass's MoE layer goes to the expert backend as layer `block.index` (the expert
services host the NextN layer's experts when this drafter is on).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence

import torch

from splitmoe.attention_service.engine.speculation import Drafter
from splitmoe.attention_service.model.batch import SeqSlice, StepBatch
from splitmoe.attention_service.model.block_manager import BlockManager
from splitmoe.attention_service.model.kv_cache import KVCache
from splitmoe.attention_service.model.nextn import NextNBlock, load_nextn
from splitmoe.attention_service.model.runner import ModelRunner
from splitmoe.attention_service.model.sequence import Sequence as ModelSequence
from splitmoe.modelfile.architectures import arch_spec

log = logging.getLogger(__name__)

# A request that has not drafted for this many positions (speculation stepped aside for a large
# batch) starts its block's context again from the newest rows: bounded memory for its hidden rows.
MAX_PENDING_ROWS = 2048


@dataclass
class _Request:
    base: int = 0        # the main model's position of the block's local row 0
    done: int = 0        # local rows computed from confirmed inputs (the block's KV holds them)
    hidden_start: int = 0  # the main model's position of pending[0]
    pending: list[torch.Tensor] = field(default_factory=list)  # [n, D] float32 chunks, positions in order

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + sum(len(p) for p in self.pending)


class MTPDrafter(Drafter):
    def __init__(self, runner: ModelRunner):
        g, cfg, o = runner.gguf, runner.cfg, runner.options
        self.block = NextNBlock(runner.model, load_nextn(g, arch_spec(g.arch, g.path.name), cfg, o.dtype, o.device))
        num_blocks = -(-o.kv_cache_tokens // o.kv_block_tokens)
        self.kv = KVCache(1, num_blocks, o.kv_block_tokens, self.block.kv_entry_shapes(), o.dtype, o.device,
                          runner.kv.format)
        self.blocks = BlockManager(num_blocks, o.kv_block_tokens)
        self.device = o.device
        self._requests: dict[int, _Request] = {}
        runner.hidden_sink = self._observe
        log.info("MTP drafter: %s's NextN block (layer %d) drafts; its own KV cache of %d tokens",
                 g.path.name, self.block.w.index, num_blocks * o.kv_block_tokens)

    def _observe(self, seq: ModelSequence, start: int, hidden: torch.Tensor) -> None:
        """A step's rows of `seq` from position `start`: rows from there on replace what was kept."""
        r = self._requests.setdefault(seq.seq_id, _Request(base=start, hidden_start=start))
        if start < r.base + r.done:  # recomputed (a preempted request): the block ran those rows already
            hidden, start = hidden[r.base + r.done - start:], r.base + r.done
        if start != r.hidden_end:
            if start < r.hidden_start or start > r.hidden_end:
                self._restart(seq.seq_id, r, start)
            else:
                self._cut(r, start)
        r.pending.append(hidden.to(self.device))
        if r.hidden_end - r.hidden_start > MAX_PENDING_ROWS:
            newest = torch.cat(r.pending)[-MAX_PENDING_ROWS:]
            self._restart(seq.seq_id, r, r.hidden_end - len(newest))
            r.pending = [newest]

    def propose(self, key: int, tokens: Sequence[int], num_tokens: int) -> list[int]:
        r = self._requests.get(key)
        n = len(tokens)
        if r is None or r.hidden_end < n - 1:  # the main model has not seen the last token's predecessor
            return []
        first = r.base + r.done
        if first >= n - 1:
            return []
        hidden = self._take(r, first, n - 1)
        g, logits = self._run(key, r.done, hidden, tokens[first + 1:n])
        r.done = n - 1 - r.base
        drafted = [int(logits[-1].argmax())]
        for k in range(1, num_tokens):
            g, logits = self._run(key, r.done + k - 1, g[-1:], drafted[-1:])
            drafted.append(int(logits[-1].argmax()))
        return drafted

    def release(self, key: int) -> None:
        if self._requests.pop(key, None) is not None:
            self.blocks.free(key)

    def _run(self, key: int, local_start: int, hidden: torch.Tensor,
             next_tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The block over local rows local_start.. (one per hidden row); its last row's logits."""
        num_rows, end = len(hidden), local_start + len(hidden)
        self.blocks.reserve(key, end)
        context = self.blocks.slots(key, 0, end).to(self.device)
        batch = StepBatch(
            token_ids=torch.tensor(list(next_tokens), dtype=torch.long, device=self.device),
            positions=torch.arange(local_start, end, device=self.device),
            new_slots=context[local_start:],
            seqs=(SeqSlice(0, num_rows, context),),
            logits_rows=torch.tensor([num_rows - 1], dtype=torch.long, device=self.device),
        )
        return self.block.forward(hidden, batch.token_ids, batch, self.kv)

    def _restart(self, key: int, r: _Request, start: int) -> None:
        """The block's context starts again at main position `start` (rows before it are gone)."""
        self.blocks.free(key)
        r.base, r.done, r.hidden_start, r.pending = start, 0, start, []

    @staticmethod
    def _cut(r: _Request, end: int) -> None:
        """Keep the pending rows of positions before `end` only."""
        if r.pending:
            r.pending = [torch.cat(r.pending)[:max(0, end - r.hidden_start)]]

    @staticmethod
    def _take(r: _Request, start: int, end: int) -> torch.Tensor:
        """The pending rows of positions start..end-1, which the block now runs; the rows after
        `end` (of drafts not yet checked) go, as the next step's rows replace them."""
        rows = torch.cat(r.pending)[start - r.hidden_start:end - r.hidden_start]
        r.pending, r.hidden_start = [], end
        return rows
