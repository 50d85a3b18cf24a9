"""Greedy generation for one prompt in one process: the reference the served path must equal."""
from __future__ import annotations

from typing import Iterator

from splitmoe.attention_service.model.runner import ModelRunner
from splitmoe.attention_service.model.sequence import Sequence


def greedy_tokens(runner: ModelRunner, prompt_ids: list[int], max_new_tokens: int,
                  stop_ids: frozenset[int] = frozenset()) -> Iterator[int]:
    """Yield greedy tokens until `max_new_tokens` or a stop token (which is yielded too)."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    seq = Sequence(seq_id=0, token_ids=list(prompt_ids))
    try:
        for _ in range(max_new_tokens):
            token = int(runner.step([seq])[0].argmax())
            yield token
            if token in stop_ids:
                return
            seq.token_ids.append(token)
    finally:
        runner.release(seq)
