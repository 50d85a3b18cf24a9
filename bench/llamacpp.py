"""The peer: llama.cpp on the same file, thread count and workload, through `llama-cpp-python`'s
low-level API (the optional `bench` extra), the way llama-batched-bench drives it.

It runs in a child process (`python -m splitmoe.bench.llamacpp`): llama.cpp's own thread pool and its
stderr chatter stay out of the benchmark process, and its memory is returned when it exits. The
child prints one JSON object on stdout.

Per phase, as bench.driver measures our engines: a warm-up prompt; prefill = one batch of each
prefill prompt with logits of its last token only (the fastest counts); single stream = a prompt,
then one token per step, each the argmax of the last logits (greedy, as our engines decode);
concurrent streams = a context with one KV sequence per stream, their short prompts in one batch,
then one batch per step holding one token of every sequence (llama-batched-bench's default,
non-shared prompts).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from splitmoe.bench.workload import Prompts, Workload

PACKAGE = "llama-cpp-python"


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


@dataclass(frozen=True, slots=True)
class LlamaCppResult:
    prefill_tok_s: float
    ttft_s: float
    decode_tok_s: float
    decode16_tok_s: float
    version: str
    sweep_tok_s: dict = field(default_factory=dict)  # more stream counts (Workload.sweep): aggregate decode


def run_baseline(model_path: str, workload: Workload, prompts: Prompts, threads: int, log_path: Path,
                 timeout_s: float = 1800.0) -> LlamaCppResult:
    """Run the baseline in a child process; its llama.cpp log goes to `log_path`."""
    if not available():
        raise RuntimeError(f"--baseline llama.cpp needs the {PACKAGE} package: pip install 'splitmoe[bench]'")
    from splitmoe import user_environment  # here, not at the top: the child imports this module too

    request = {"model": model_path, "threads": threads, "workload": asdict(workload), "prompts": asdict(prompts)}
    with open(log_path, "wb") as log:
        try:
            # the user's environment: llama.cpp as it runs for them, not with our runtime defaults
            done = subprocess.run([sys.executable, "-m", "splitmoe.bench.llamacpp"], input=json.dumps(request).encode(),
                                  stdout=subprocess.PIPE, stderr=log, timeout=timeout_s,
                                  cwd=Path(__file__).resolve().parents[1], env=user_environment())
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the llama.cpp baseline did not finish within {timeout_s:g} s (log: {log_path})") from None
    if done.returncode != 0:
        raise child_failed("the llama.cpp baseline", done.returncode, log_path)
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    result = json.loads(lines[-1])  # the last line: llama.cpp may print before it
    result["sweep_tok_s"] = {int(n): v for n, v in result.get("sweep_tok_s", {}).items()}  # JSON made them text
    return LlamaCppResult(**result)


def child_failed(what: str, returncode: int, log_path: Path) -> RuntimeError:
    """A peer's process that exited badly, with the last lines of its log: the error to raise."""
    tail = log_path.read_text(errors="replace").splitlines()[-15:]
    return RuntimeError(f"{what} exited with code {returncode}; last lines of {log_path}:\n"
                        + "\n".join("    " + line for line in tail))


# ---- the child ----------------------------------------------------------------------------------

class _Llama:
    """One model, and a context at a time, over llama_cpp's ctypes bindings."""

    def __init__(self, model_path: str, threads: int):
        import llama_cpp as L

        self.L, self.threads = L, threads
        L.llama_backend_init()
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0  # CPU, as our services run here
        self.model = L.llama_model_load_from_file(model_path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = None

    def new_context(self, n_ctx: int, n_batch: int, n_seq_max: int) -> None:
        L = self.L
        self.free_context()
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, n_batch, n_seq_max
        params.n_threads = params.n_threads_batch = self.threads
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(n_batch, 0, n_seq_max)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants logits); returns the argmax token of every
        entry that wanted logits, in order."""
        import numpy as np

        L, b = self.L, self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        n_out = sum(1 for e in entries if e[3])
        logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab))
        return logits.argmax(axis=1).tolist()

    def free_context(self) -> None:
        if self.ctx:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.ctx = None

    def close(self) -> None:
        self.free_context()
        self.L.llama_model_free(self.model)


def _prompt(ids: list[int], seq: int = 0) -> list[tuple[int, int, int, bool]]:
    return [(t, i, seq, i == len(ids) - 1) for i, t in enumerate(ids)]


def measure_llamacpp(model_path: str, threads: int, workload: Workload, prompts: Prompts) -> LlamaCppResult:
    import llama_cpp

    w, llm = workload, _Llama(model_path, threads)
    try:
        # One sequence: the long prompt plus its decode.
        llm.new_context(n_ctx=_round_up(w.prompt_tokens + w.decode_tokens, 256), n_batch=max(512, w.prompt_tokens),
                        n_seq_max=1)
        llm.decode(_prompt(prompts.warmup))
        llm.clear()
        prefill_s = float("inf")
        for ids in prompts.prefills:  # the fastest counts, as for our engines (bench.driver)
            start = time.perf_counter()
            llm.decode(_prompt(ids))
            prefill_s = min(prefill_s, time.perf_counter() - start)
            llm.clear()

        start = time.perf_counter()
        token = llm.decode(_prompt(prompts.single))[0]
        ttft_s = time.perf_counter() - start
        start = time.perf_counter()
        for pos in range(w.prompt_tokens, w.prompt_tokens + w.decode_tokens - 1):
            token = llm.decode([(token, pos, 0, True)])[0]
        decode_s = time.perf_counter() - start

        decode16_tok_s = _batched_decode_tok_s(llm, w, prompts.streams)
        sweep = {n: _batched_decode_tok_s(llm, w, prompts.streams[:n]) for n in w.sweep}
    finally:
        llm.close()
    return LlamaCppResult(prefill_tok_s=w.prompt_tokens / prefill_s, ttft_s=ttft_s,
                          decode_tok_s=(w.decode_tokens - 1) / decode_s, decode16_tok_s=decode16_tok_s,
                          version=getattr(llama_cpp, "__version__", "unknown"), sweep_tok_s=sweep)


def _batched_decode_tok_s(llm: _Llama, w: Workload, streams: list[list[int]]) -> float:
    """Concurrent streams, one KV sequence each (llama.cpp splits n_ctx evenly between them), one
    batch per step holding a token of every sequence, as llama-batched-bench does."""
    per_seq = _round_up(w.stream_prompt_tokens + w.decode_tokens, 256)
    llm.new_context(n_ctx=len(streams) * per_seq, n_batch=max(512, len(streams) * w.stream_prompt_tokens),
                    n_seq_max=len(streams))
    tokens = llm.decode([e for s, ids in enumerate(streams) for e in _prompt(ids, s)])
    start = time.perf_counter()
    for pos in range(w.stream_prompt_tokens, w.stream_prompt_tokens + w.decode_tokens - 1):
        tokens = llm.decode([(t, pos, s, True) for s, t in enumerate(tokens)])
    return len(streams) * (w.decode_tokens - 1) / (time.perf_counter() - start)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description="the llama.cpp baseline of `splitmoe bench run`: a JSON request on stdin "
                                        "(model, threads, workload, prompts), a JSON result on stdout").parse_args(argv)
    request = json.load(sys.stdin)
    workload = request["workload"]
    workload["sweep"] = tuple(workload.get("sweep", ()))
    result = measure_llamacpp(request["model"], request["threads"], Workload(**workload), Prompts(**request["prompts"]))
    print("\n" + json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
