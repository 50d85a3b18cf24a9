"""`--speculative draft --model-draft FILE`: a small model of the same vocabulary drafts the tokens.

As llama-server's `--model-draft` and vLLM's draft-model speculation: the draft model runs in the
attention process, whole (its experts too), with a KV cache of its own. Per request it keeps a
sequence; each proposal first catches the sequence up with what the target accepted since (its
KV up to the first token that differs is kept, the rest recomputed), then decodes greedily the
tokens asked for, one step each. Its cache names no blocks: a sequence cut back to what was
accepted would otherwise leave named blocks whose contents changed.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from splitmoe.attention_service.engine.speculation import Drafter
from splitmoe.attention_service.expert_backends.backend import InProcessExperts
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence as ModelSequence
from splitmoe.modelfile.gguf_file import GGUFFile


class DraftModelDrafter(Drafter):
    def __init__(self, path: str, options: RunnerOptions, target_vocab_size: int):
        g = GGUFFile(path)
        self.runner = ModelRunner.from_gguf(g, dataclasses.replace(options, prefix_caching=False), InProcessExperts(g))
        if self.runner.cfg.vocab_size != target_vocab_size:
            raise ValueError(f"--model-draft {path}: vocabulary of {self.runner.cfg.vocab_size} tokens, the model "
                             f"served has {target_vocab_size}: a draft model must share the vocabulary")
        self._seqs: dict[int, ModelSequence] = {}
        self._ids = itertools.count(1)

    def propose(self, key: int, tokens: Sequence[int], num_tokens: int) -> list[int]:
        seq = self._seqs.get(key)
        if seq is None:
            seq = self._seqs[key] = ModelSequence(next(self._ids), [])
        kept = _common_prefix(seq.token_ids, tokens)
        seq.num_cached_tokens = min(seq.num_cached_tokens, kept)
        seq.token_ids = list(tokens)
        if seq.num_cached_tokens >= len(tokens):  # the last token must be run to predict the next
            seq.num_cached_tokens = len(tokens) - 1
        drafted = []
        for _ in range(num_tokens):
            logits = self.runner.step([seq])
            token = int(logits[-1].argmax())
            drafted.append(token)
            seq.token_ids.append(token)
        return drafted

    def release(self, key: int) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.runner.release(seq)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
