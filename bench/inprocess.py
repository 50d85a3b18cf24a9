"""The in-process run: the attention service's own engine (scheduler, model runner, sampler) and
all experts in this one process, with no gRPC anywhere; the same workload as the services run.

The experts sit behind `RecordingExperts`, which counts the distinct experts each decode step of
the concurrent streams touches: the bytes the 16-stream bandwidth ceiling is computed from.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from splitmoe.bench.ceiling import ExpertBytes, RecordingExperts
from splitmoe.bench.driver import STREAMS_END, STREAMS_START, Measured, measure
from splitmoe.bench.workload import Prompts, Workload


@dataclass(frozen=True, slots=True)
class InProcessResult:
    measured: Measured
    touched_expert_bytes_per_step: float | None  # distinct experts of one all-streams decode step


def run_inprocess(g, workload: Workload, prompts: Prompts, threads: int, dtype: str, expert_bytes: ExpertBytes,
                  say: Callable[[str], None]) -> InProcessResult:
    """g: the model's GGUFFile, already open (opening parses the whole vocabulary: seconds)."""
    import torch

    from splitmoe.attention_service.expert_backends.backend import InProcessExperts
    from splitmoe.attention_service.model.runner import DTYPES, RunnerOptions
    from splitmoe.attention_service.service import load_serving_model
    from splitmoe.attention_service.settings import AttentionSettings
    from splitmoe.runtime.heap import freeze_startup_heap, thaw_heap

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    w = workload
    settings = AttentionSettings(model_path=str(g.path),
                                 runner=RunnerOptions(dtype=DTYPES[dtype], device=torch.device("cpu"), kv_cache_tokens=w.kv_tokens()),
                                 max_batch_tokens=max(512, w.prompt_tokens, w.streams * w.stream_prompt_tokens),
                                 max_running_seqs=max(64, w.streams))
    recorder = RecordingExperts(InProcessExperts(g))
    model = load_serving_model(settings, experts=recorder)
    freeze_startup_heap()  # as the services freeze theirs once loaded
    model.engine.start()
    try:
        measured = asyncio.run(measure(InProcessEngine(model, recorder), workload, prompts, say))
    finally:
        model.engine.stop()
        thaw_heap()
        torch.set_num_threads(previous_threads)
    return InProcessResult(measured, recorder.touched_bytes_per_step(expert_bytes, w.streams))


class InProcessEngine:
    """splitmoe.bench.driver's engine over attention_service.engine.Engine; a token's time is taken on the
    engine thread as the step hands it out."""

    def __init__(self, model, recorder: RecordingExperts):
        self.model, self.recorder = model, recorder

    async def generate(self, ids: list[int], max_tokens: int) -> AsyncIterator[float]:
        from splitmoe.attention_service.engine.sampling import SamplingOptions

        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def sink(out) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, (time.perf_counter(), out))

        request = self.model.new_request(f"bench-{uuid.uuid4().hex[:12]}", ids,
                                         SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), sink)
        self.model.engine.submit(request)
        while True:
            arrived_s, out = await outputs.get()
            if out.error:
                raise RuntimeError(f"in-process engine: {out.error}")
            yield arrived_s
            if out.finished:
                return

    def mark(self, moment: str) -> None:
        if moment == STREAMS_START:
            self.recorder.recording = True
        elif moment == STREAMS_END:
            self.recorder.recording = False
