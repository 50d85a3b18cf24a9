"""Choosing the next token from logits, per request: penalties, temperature, top-k/top-p/min-p.

Logprobs are the model's own distribution (log-softmax of the raw logits), as vLLM reports by
default, so they do not depend on the sampling knobs.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """What the sampling options mean: their defaults and ranges. Their names are proto/attention.proto's
    SamplingParams fields, which server.py copies by name; a typed object, read at every sampled token."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    num_experts_per_token: int = 0  # routed experts per token for this request; 0: the server's

    def __post_init__(self):
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError("temperature must be in [0, 2]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True, slots=True)
class Sampled:
    token_id: int
    logprob: float | None  # None unless the request asked for logprobs or top logprobs
    top: tuple[tuple[int, float], ...]  # (token id, logprob), best first


class RequestSampler:
    """One request's sampling state: its options, its seeded generator, the tokens it has seen."""

    def __init__(self, options: SamplingOptions, vocab_size: int, prompt_ids: Sequence[int] = ()):
        self.options = options
        self._generator = None
        if options.seed is not None:
            self._generator = torch.Generator().manual_seed(options.seed)
        # Output token counts, for the presence and frequency penalties only.
        self._counts = None
        if options.presence_penalty or options.frequency_penalty:
            self._counts = torch.zeros(vocab_size, dtype=torch.float32)
        # Tokens of the prompt or the output so far, for the repetition penalty only.
        self._seen = None
        if options.repetition_penalty != 1.0:
            self._seen = torch.zeros(vocab_size, dtype=torch.bool)
            self._seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True

    def __call__(self, logits: torch.Tensor) -> Sampled:
        """logits: float32 [vocab] on the CPU.

        The logprobs are logits − logsumexp(logits): one pass over the vocabulary instead of a
        whole log-softmax written out, per token; none at all when the request wants none.
        """
        o = self.options
        token = self._choose(self._penalize(logits))
        if self._counts is not None:
            self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
        if not (o.logprobs or o.top_logprobs):
            return Sampled(token, None, ())
        norm = torch.logsumexp(logits, dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if o.top_logprobs:
            values, ids = torch.topk(logits, o.top_logprobs)
            top = tuple(zip(ids.tolist(), (values - norm).tolist()))
        return Sampled(token, float(logits[token] - norm), top)

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's order and definitions: the repetition penalty (CTRL's) divides the positive logits and
        multiplies the negative ones of every token in the prompt or the output; then OpenAI's
        penalties subtract per token seen in the output."""
        o = self.options
        if self._seen is not None:
            penalized = torch.where(logits > 0, logits / o.repetition_penalty, logits * o.repetition_penalty)
            logits = torch.where(self._seen, penalized, logits)
        if self._counts is not None:
            logits = logits - o.frequency_penalty * self._counts - o.presence_penalty * (self._counts > 0).float()
        return logits

    def _choose(self, logits: torch.Tensor) -> int:
        o = self.options
        if o.greedy:
            return _argmax(logits)
        logits = logits / o.temperature
        if o.top_k:
            kth = torch.topk(logits, min(o.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if o.min_p:
            probs = probs.masked_fill(probs < o.min_p * probs.max(), 0.0)
        if o.top_p < 1.0:
            probs = _top_p(probs, o.top_p)
        return int(torch.multinomial(probs, 1, generator=self._generator))


def _argmax(logits: torch.Tensor) -> int:
    """The first index of the largest value (as torch.argmax), through numpy on the CPU, whose
    vectorised argmax is ~15x faster than torch's over a 150k vocabulary."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return int(logits.numpy().argmax())
    return int(logits.argmax())


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p * sorted_probs.sum(), 0.0)
    return torch.zeros_like(probs).scatter(0, order, sorted_probs)
