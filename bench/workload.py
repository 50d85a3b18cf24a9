"""What `splitmoe bench run` asks of every engine (services, in-process, llama.cpp), and the
figures it derives from token arrival times, so all three are measured the same way.

The workload: a warm-up prompt, `prefill_runs` prompts of `prompt_tokens` answered with a single
token each (prefill: the fastest counts, for every engine alike, as one run on a busy machine can
be slowed by anything),
the same length answered with `decode_tokens` tokens (time to first token, single-stream decode),
then `streams` short prompts decoded together for `decode_tokens` tokens each (aggregate decode),
then `streams` copies of one more short prompt decoded together: greedy, every stream takes the same
tokens and routes to the same experts, as ik_llama.cpp's batched-bench streams do (they all decode
token 0), so its figure has a like-for-like one of ours.
Prompts are token ids drawn from the model's normal tokens with a fixed seed: random-weight models
have no meaningful text, and ids avoid any tokenizer round trip.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TOKEN_TYPE_NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL, as GGUF's tokenizer.ggml.token_type stores it


@dataclass(frozen=True, slots=True)
class Workload:
    prompt_tokens: int = 512          # prefill / time-to-first-token prompt
    decode_tokens: int = 128          # tokens generated per stream (the first comes from the prefill)
    streams: int = 16                 # concurrent streams of the aggregate decode
    stream_prompt_tokens: int = 16    # each concurrent stream's own short prompt
    seed: int = 0
    prefill_runs: int = 3             # distinct prefill prompts timed; the fastest counts
    # More concurrent-stream counts to decode at (the curve of `--plot`), besides 1 and `streams`.
    sweep: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.stream_prompt_tokens < 1:
            raise ValueError("--prompt-tokens and the streams' prompts need at least one token")
        if self.decode_tokens < 2:
            raise ValueError(f"--decode-tokens must be >= 2 (the first token comes from the prefill), "
                             f"got {self.decode_tokens}")
        if self.streams < 1:
            raise ValueError(f"--streams must be >= 1, got {self.streams}")
        if self.prefill_runs < 1:
            raise ValueError(f"prefill_runs must be >= 1, got {self.prefill_runs}")
        object.__setattr__(self, "sweep", tuple(sorted({int(n) for n in self.sweep} - {1, self.streams})))
        if any(not 1 < n < self.streams for n in self.sweep):
            raise ValueError(f"sweep stream counts must lie between 1 and --streams {self.streams}: {self.sweep}")

    def kv_tokens(self) -> int:
        """KV cache tokens one engine needs for the largest phase, rounded up to 256."""
        need = max(self.prompt_tokens + self.decode_tokens,
                   self.streams * (self.stream_prompt_tokens + self.decode_tokens))
        return -(-need // 256) * 256 + 256


@dataclass(frozen=True, slots=True)
class Prompts:
    warmup: list[int]
    prefills: list[list[int]]
    single: list[int]
    streams: list[list[int]] = field(default_factory=list)
    alike: list[int] = field(default_factory=list)  # every stream of the alike phase asks this one


def normal_token_ids(token_types: list[int] | None, vocab_size: int) -> np.ndarray:
    """Ids of the vocabulary's normal tokens (no control, byte-fallback or unused entries)."""
    if token_types and len(token_types) == vocab_size:
        ids = np.flatnonzero(np.asarray(token_types) == TOKEN_TYPE_NORMAL)
        if ids.size:
            return ids
    return np.arange(vocab_size)


def make_prompts(workload: Workload, candidates: np.ndarray) -> Prompts:
    """Distinct prompts per phase (no engine may reuse another phase's cache), the same every run."""
    rng = np.random.default_rng(workload.seed)

    def draw(n: int) -> list[int]:
        return [int(i) for i in rng.choice(candidates, size=n)]

    w = workload
    return Prompts(draw(w.prompt_tokens), [draw(w.prompt_tokens) for _ in range(w.prefill_runs)],
                   draw(w.prompt_tokens), [draw(w.stream_prompt_tokens) for _ in range(w.streams)],
                   draw(w.stream_prompt_tokens))


# ---- figures from arrival times -----------------------------------------------------------------
# Every engine reports, per stream, the perf_counter time it asked and the time each token arrived.

@dataclass(slots=True)
class StreamTimes:
    start_s: float
    token_s: list[float] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        return self.token_s[0] - self.start_s


def prefill_tok_s(num_prompt_tokens: int, times: StreamTimes) -> float:
    """A max_tokens=1 request: the prompt's tokens over the time until its one token arrived."""
    return num_prompt_tokens / (times.token_s[-1] - times.start_s)


def decode_tok_s(times: StreamTimes) -> float:
    """One stream: tokens after the first over the time from the first to the last."""
    return (len(times.token_s) - 1) / (times.token_s[-1] - times.token_s[0])


def aggregate_decode_tok_s(streams: list[StreamTimes]) -> float:
    """All streams together: every token after each stream's first, over the time from the first
    stream's first token to the last stream's last. Streams admitted in one step (the prompts fit
    one step's token budget) make this exactly the lockstep rate llama-batched-bench reports."""
    total = sum(len(s.token_s) - 1 for s in streams)
    return total / (max(s.token_s[-1] for s in streams) - min(s.token_s[0] for s in streams))
