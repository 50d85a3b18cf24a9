"""Speculative decoding: drafted tokens verified in one step (issue 30).

A step through SplitMoE pays one round trip to the expert services per MoE layer whatever the
number of tokens in it: a decoding sequence that carries K drafted tokens has all K+1 positions
scored in that one pass (one hop per layer carrying every row), and keeps the drafts up to the
first the model would not have chosen, plus the model's own token there (or after the last).

What is verified and how (engine.py does it, with this module's pieces):
- Every request without a grammar speculates. Each drafted position's token is chosen by the
  request's own sampler in order (penalties, bias, min_tokens and logprobs see the tokens before
  it, as one token at a time): greedy, its argmax, a draft kept when they agree, which gives
  exactly the tokens decoding one at a time gives; sampling, rejection sampling (the draft kept
  with probability p(draft), else a token drawn from p without it), which gives tokens distributed
  exactly as p. Requests with a grammar decline, and decode as before.
- The drafts' KV is written like any token's; after the check the sequence is cut back to what was
  accepted, and the cache blocks are named (prefix caching) only then, from the accepted tokens.
- Drafts: `propose_ngram`, prompt lookup as vLLM's `[ngram]` and llama.cpp's lookup decoding do it:
  the longest recent n-gram that occurred before in the prompt or the output, and what followed it;
  or a small model's greedy tokens (engine/draft_model.py).
- Speculation steps aside when more than `max_batch_seqs` sequences decode together: a step that
  large is bound by computing the experts, which K+1 positions per sequence would multiply.
- How many tokens to draft follows each request's measured acceptance (`DraftLength`): in a MoE
  model every drafted token routes to its own experts, so a step of K+1 tokens reads up to K+1
  tokens' experts. Measured whole engine steps (Qwen3-30B-A3B shape, Zen 5, bench/spec_bench.py:
  drafts that never hold): a step verifying 4 drafts took 1.7-1.9 one-token steps, 6 and 24 layers,
  in this process and through a service: ~0.2 of a step per drafted token (the runner's part
  alone, without the step's fixed costs, ~0.4). K is chosen to make the most tokens per unit of
  step time at 0.25 a drafted token, none while drafts are not paying (a one-token probe now and then).
"""
from __future__ import annotations

import abc
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

METHODS = ("none", "ngram", "draft", "mtp")
MAX_SPECULATIVE_TOKENS = 15  # a verification step stays on the decode layer's path (model/attention.py)


@dataclass(frozen=True, slots=True)
class SpeculationSettings:
    method: str = "none"        # none | ngram | draft | mtp
    num_tokens: int = 4         # drafted tokens per step and sequence (vLLM's num_speculative_tokens)
    max_batch_seqs: int = 8     # no drafts while more sequences than this decode together
    ngram_max: int = 4          # the longest n-gram looked up (vLLM's prompt_lookup_max)
    ngram_min: int = 1          # the shortest (prompt_lookup_min)
    draft_token_cost: float = 0.25  # a drafted token's cost, in one-token steps (see the module docstring)
    draft_model: str = ""       # method draft: a small GGUF with the target's vocabulary (--model-draft)
    fixed_length: bool = False  # draft num_tokens every step, as vLLM does, instead of the measured best K

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative {self.method!r}: want one of {', '.join(METHODS)}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS or self.max_batch_seqs < 1:
            raise ValueError(f"--num-speculative-tokens {self.num_tokens}: want 1..{MAX_SPECULATIVE_TOKENS} "
                             "(and a batch limit >= 1)")
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError("--speculative draft takes --model-draft FILE (and --model-draft only goes with it)")
        if self.draft_token_cost <= 0:
            raise ValueError("a drafted token's cost must be positive")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"n-gram lengths {self.ngram_min}..{self.ngram_max}: want 1 <= min <= max")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass
class SpeculationStats:
    """Counters with vLLM's meanings: drafts proposed, draft tokens, accepted ones (and per position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        while len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position.append(0)
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class DrafterCost:
    """What the drafter's own work costs a drafted token, in one-token decode steps, measured as
    it runs: proposing (the n-gram lookup: microseconds; a draft model or the MTP block: a forward
    pass per token, which may be a large part of a step on a shallow file) over the step time,
    each step's time counted as its one-token equivalent under the verification cost model."""

    step_s: float = 0.0       # decayed mean of a one-token decode step
    token_s: float = 0.0      # decayed mean of the drafter's time per drafted token

    def add_step(self, seconds: float, num_seqs: int, num_drafted: int, draft_token_cost: float) -> None:
        one_token = seconds / (1.0 + draft_token_cost * num_drafted / max(1, num_seqs))
        self.step_s = _decayed(self.step_s, one_token)

    def add_proposal(self, seconds: float, num_tokens: int) -> None:
        if num_tokens:
            self.token_s = _decayed(self.token_s, seconds / num_tokens)

    @property
    def steps_per_token(self) -> float:
        return self.token_s / self.step_s if self.step_s else 0.0


def _decayed(mean: float, sample: float, weight: float = 0.1) -> float:
    return sample if not mean else mean + weight * (sample - mean)


PROBE_EVERY_STEPS = 16  # a request whose drafts stopped paying drafts one token this often
DECAY = 0.9  # of the acceptance counts at each verification: recent text weighs most


@dataclass
class DraftLength:
    """How many tokens to draft next for one request, from its own acceptance so far.

    Acceptance is modelled as each drafted token holding with probability a, given the ones before
    it held: a = accepted / (accepted + rejected), decayed counts, started at one each (a = 0.5).
    A step with K drafts then yields (1 - a^(K+1)) / (1 - a) tokens for 1 + cost·K one-token
    steps' time; the K in 0..max that yields most per unit of time is drafted."""

    accepted: float = 1.0
    rejected: float = 1.0
    steps_without: int = 0

    def update(self, num_drafted: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.rejected = self.rejected * DECAY + (num_accepted < num_drafted)

    def next(self, max_tokens: int, cost: float) -> int:
        a = self.accepted / (self.accepted + self.rejected)
        best = max(range(max_tokens + 1), key=lambda k: (_expected_tokens(a, k) / (1 + cost * k), -k))
        if best == 0:
            self.steps_without += 1
            if self.steps_without >= PROBE_EVERY_STEPS:
                self.steps_without = 0
                return min(1, max_tokens)
        return best


def _expected_tokens(a: float, k: int) -> float:
    """Tokens a step with k drafts yields when each holds with probability a: 1 + a + ... + a^k."""
    return k + 1.0 if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


class Drafter(abc.ABC):
    """Proposes a request's next tokens; `release` forgets a finished request (a draft model's KV).
    A request is known by its sequence's id (`seq_id`: what the runner's hidden states name too)."""

    @abc.abstractmethod
    def propose(self, key: int, tokens: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` tokens to follow `tokens`, the sequence of request `key`."""

    def release(self, key: int) -> None:
        """Nothing to forget by default."""


class FunctionDrafter(Drafter):
    """A drafter from a function of (tokens, how many): the n-gram lookup; oracles in benchmarks."""

    def __init__(self, propose: Callable[[Sequence[int], int], list[int]]):
        self._propose = propose

    def propose(self, key: int, tokens: Sequence[int], num_tokens: int) -> list[int]:
        return self._propose(tokens, num_tokens)


def ngram_drafter(settings: SpeculationSettings) -> Drafter:
    return FunctionDrafter(lambda tokens, k: propose_ngram(tokens, k, settings.ngram_max, settings.ngram_min))


def propose_ngram(tokens: Sequence[int], num_tokens: int, ngram_max: int = 4, ngram_min: int = 1) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (from `ngram_max` tokens down to `ngram_min`); [] when no suffix occurred before.

    Searched as bytes (C's search, not a Python loop: a step must not pay milliseconds for a long
    context), matches kept only on token boundaries."""
    n_tokens = len(tokens)
    if n_tokens < 2:
        return []
    data = array("i", tokens).tobytes()
    width = array("i").itemsize  # bytes a token
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        pattern = data[(n_tokens - n) * width:]
        end = (n_tokens - 1) * width  # an earlier occurrence ends before the last token
        at = data.rfind(pattern, 0, end)
        while at > 0 and at % width:
            at = data.rfind(pattern, 0, at + len(pattern) - 1)
        if at >= 0:
            start = at // width + n  # latest match first: recent text predicts the next tokens best
            follow = list(tokens[start:start + num_tokens])
            if follow:
                return follow
    return []
