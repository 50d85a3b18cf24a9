"""Choosing the next token from logits, per request: penalties, logit bias, temperature, top-k/top-p/min-p.

Logprobs are the model's own distribution (log-softmax of the raw logits), as vLLM reports by
default, so they do not depend on the sampling knobs.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token, 100 all but forces it


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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), OpenAI's logit_bias
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: end the generation like EOS, even with ignore_eos
    min_tokens: int = 0  # vLLM's: EOS and stop_token_ids are masked until this many tokens are out

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
        if not 0.0 < self.repetition_penalty < math.inf:  # any positive value, as vLLM and llama.cpp take
            raise ValueError("repetition_penalty must be a finite number > 0")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias: biases must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

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

    def __init__(self, options: SamplingOptions, vocab_size: int, prompt_ids: Sequence[int] = (),
                 eos_ids: frozenset[int] = frozenset()):
        """`eos_ids`: the model's own stop tokens, masked with stop_token_ids until min_tokens are out."""
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
        self._bias = _bias_tensors(options.logit_bias, vocab_size)
        self._num_sampled = 0
        self._early_stops = None
        if options.min_tokens:
            ids = sorted(i for i in (*eos_ids, *options.stop_token_ids) if 0 <= i < vocab_size)
            self._early_stops = torch.tensor(ids, dtype=torch.long)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that reads or changes the logits but the argmax: such a request's
        token can be chosen where the logits are (on a GPU) and only the token id moved."""
        o = self.options
        return (o.greedy and self._seen is None and self._counts is None and self._bias is None
                and self._early_stops is None and not (o.logprobs or o.top_logprobs))

    def take(self, token: int) -> Sampled:
        """The token a plainly greedy request's argmax chose elsewhere, counted as if sampled here."""
        self._num_sampled += 1
        return Sampled(token, None, ())

    def __call__(self, logits: torch.Tensor) -> Sampled:
        """logits: float32 [vocab] on the CPU.

        The logprobs are logits − logsumexp(logits): one pass over the vocabulary instead of a
        whole log-softmax written out, per token; none at all when the request wants none.
        """
        return self._took(logits, self._choose(self._processed(logits)))

    def verify(self, logits: torch.Tensor, drafted: int) -> Sampled:
        """The token at a drafted position (speculative decoding), distributed exactly as `__call__`'s.

        Greedy: the argmax, as ever (the caller keeps the draft when they agree). Sampling, with a
        draft proposed with certainty (q one-hot, as the n-gram lookup's): the draft is kept with
        probability p(draft), else a token is drawn from p with the draft taken out, renormalised;
        Leviathan et al.'s rejection sampling, whose result is distributed as p itself."""
        processed = self._processed(logits)
        if self.options.greedy:
            return self._took(logits, _argmax(processed))
        probs = self._probs(processed)
        total = float(probs.sum())
        keep = float(probs[drafted]) / total if 0 <= drafted < probs.numel() else 0.0
        if float(torch.rand((), generator=self._generator)) < keep:
            return self._took(logits, drafted)
        residual = probs.clone()
        if 0 <= drafted < residual.numel():
            residual[drafted] = 0.0
        return self._took(logits, int(torch.multinomial(residual, 1, generator=self._generator)))

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        return self._masked_early_stops(self._biased(self._penalize(logits)))

    def _took(self, logits: torch.Tensor, token: int) -> Sampled:
        """Count `token` as this request's next and say what it was (with logprobs if asked)."""
        o = self.options
        self._num_sampled += 1
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

    def _biased(self, logits: torch.Tensor) -> torch.Tensor:
        """OpenAI's logit_bias, added after the penalties so that a bias means the same whatever they do."""
        if self._bias is None:
            return logits
        ids, biases = self._bias
        return logits.index_add(0, ids, biases)  # a copy: the logprobs stay the model's own

    def _masked_early_stops(self, logits: torch.Tensor) -> torch.Tensor:
        """vLLM's min_tokens: no stop token can be sampled before min_tokens are out."""
        if self._early_stops is None or self._num_sampled >= self.options.min_tokens:
            return logits
        return logits.index_fill(0, self._early_stops, float("-inf"))

    def _choose(self, logits: torch.Tensor) -> int:
        if self.options.greedy:
            return _argmax(logits)
        return int(torch.multinomial(self._probs(logits), 1, generator=self._generator))

    def _probs(self, logits: torch.Tensor) -> torch.Tensor:
        """What a sampled token is drawn from: temperature, top-k, min-p, top-p (unnormalised after the cuts)."""
        o = self.options
        logits = logits / o.temperature
        if o.top_k:
            kth = torch.topk(logits, min(o.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if o.min_p:
            probs = probs.masked_fill(probs < o.min_p * probs.max(), 0.0)
        if o.top_p < 1.0:
            probs = _top_p(probs, o.top_p)
        return probs


def _bias_tensors(logit_bias: tuple[tuple[int, float], ...], vocab_size: int
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, biases) to add, or None; an id outside the vocabulary is the caller's mistake."""
    if not logit_bias:
        return None
    ids = [token_id for token_id, _ in logit_bias]
    if not all(0 <= token_id < vocab_size for token_id in ids):
        raise ValueError(f"logit_bias: token ids must lie in [0, {vocab_size})")
    return torch.tensor(ids, dtype=torch.long), torch.tensor([b for _, b in logit_bias], dtype=torch.float32)


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
