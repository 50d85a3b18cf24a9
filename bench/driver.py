"""One measurement sequence, run the same way against the services and the in-process engine.

An engine here is anything with `generate(ids, max_tokens)`, an async iterator yielding the
perf_counter time of each generated token (greedy, EOS ignored), and `mark(moment)`, told when a
phase starts or ends (the services snapshot their hop counters there, the in-process engine
switches its expert recorder on and off); neither may block the token stream.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from splitmoe.bench.workload import Prompts, StreamTimes, Workload, aggregate_decode_tok_s, decode_tok_s, prefill_tok_s

# The moments `mark` is told about, in order.
SINGLE_START, SINGLE_FIRST_TOKEN, SINGLE_END = "single_start", "single_first_token", "single_end"
STREAMS_START, STREAMS_END = "streams_start", "streams_end"


class BenchEngine(Protocol):
    def generate(self, ids: list[int], max_tokens: int) -> AsyncIterator[float]: ...

    def mark(self, moment: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Measured:
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: float
    decode16_tok_s: float
    prefill_s: float          # the fastest max_tokens=1 request, prompt sent to token received
    decode_s: float           # single stream, first token to last
    decode16_s: float         # the concurrent streams, first token of any to last of all
    # the same number of streams, all one prompt (Prompts.alike): greedy, they route alike
    decode16_alike_tok_s: float | None = None
    sweep_tok_s: dict[int, float] = field(default_factory=dict)  # more stream counts: aggregate decode


async def measure(engine: BenchEngine, workload: Workload, prompts: Prompts,
                  say: Callable[[str], None] = lambda line: None) -> Measured:
    w = workload
    say(f"    warm-up: {len(prompts.warmup)}-token prompt")
    await generate_timed(engine, prompts.warmup, 2)
    say(f"    prefill: {len(prompts.prefills)} x {len(prompts.prefills[0])}-token prompt, 1 token (the fastest counts)")
    prefill = min([await generate_timed(engine, ids, 1) for ids in prompts.prefills],
                  key=lambda t: t.token_s[-1] - t.start_s)
    say(f"    single stream: {len(prompts.single)}-token prompt, {w.decode_tokens} tokens")
    engine.mark(SINGLE_START)
    single = await generate_timed(engine, prompts.single, w.decode_tokens,
                                  on_first_token=lambda: engine.mark(SINGLE_FIRST_TOKEN))
    engine.mark(SINGLE_END)
    say(f"    {w.streams} concurrent streams: {w.stream_prompt_tokens}-token prompts, {w.decode_tokens} tokens each")
    engine.mark(STREAMS_START)
    streams = await asyncio.gather(*(generate_timed(engine, ids, w.decode_tokens) for ids in prompts.streams))
    engine.mark(STREAMS_END)
    alike = None
    if prompts.alike:
        say(f"    {w.streams} concurrent streams of one {len(prompts.alike)}-token prompt, {w.decode_tokens} tokens each")
        alike = aggregate_decode_tok_s(list(await asyncio.gather(
            *(generate_timed(engine, prompts.alike, w.decode_tokens) for _ in range(w.streams)))))
    sweep = {}
    for n in w.sweep:
        say(f"    {n} concurrent streams (the curve)")
        runs = await asyncio.gather(*(generate_timed(engine, ids, w.decode_tokens) for ids in prompts.streams[:n]))
        sweep[n] = aggregate_decode_tok_s(list(runs))
    return Measured(
        prefill_tok_s=prefill_tok_s(len(prompts.prefills[0]), prefill), ttft_s=single.ttft_s,
        decode_tok_s=decode_tok_s(single), decode16_tok_s=aggregate_decode_tok_s(list(streams)),
        prefill_s=prefill.token_s[-1] - prefill.start_s, decode_s=single.token_s[-1] - single.token_s[0],
        decode16_s=max(s.token_s[-1] for s in streams) - min(s.token_s[0] for s in streams),
        decode16_alike_tok_s=alike, sweep_tok_s=sweep)


async def generate_timed(engine: BenchEngine, ids: list[int], max_tokens: int,
                         on_first_token: Callable[[], None] | None = None) -> StreamTimes:
    times = StreamTimes(time.perf_counter())
    async for arrived_s in engine.generate(ids, max_tokens):
        times.token_s.append(arrived_s)
        if on_first_token is not None and len(times.token_s) == 1:
            on_first_token()
    if len(times.token_s) != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens, got {len(times.token_s)}")
    return times
