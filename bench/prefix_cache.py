"""Time to first token on a shared-system-prompt workload, prefix caching on and off, in one run.

    python -m splitmoe.bench.prefix_cache --model q3_6l.gguf --threads 2 [--requests 16]
        [--prefix-tokens 1000] [--suffix-tokens 16] [--max-tokens 8] [--dtype bfloat16] [--json FILE]

`--requests` requests arrive together, each a common `--prefix-tokens` prefix (a system prompt)
and a distinct `--suffix-tokens` suffix (the user's turn), and generate `--max-tokens` greedily.
The same model is loaded twice into the attention service's own engine (experts in-process),
caching on then off, each after a warm-up request of unrelated tokens. Reports each side's time to
first token (mean, p50, max; from submit to the token leaving the engine), the prefix cache's hit
rate (hit tokens over queried tokens), the wall time, the ratios, and how many requests generated
the same tokens on both sides (in bfloat16, batch shapes move the last bits, see docs/models.md, prefix caching).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import numpy as np

import splitmoe  # noqa: F401 - first: the runtimes' defaults, before torch loads (splitmoe/__init__.py)


@dataclass(frozen=True, slots=True)
class SideResult:
    prefix_caching: bool
    ttft_s: list[float]
    wall_s: float
    queries: int
    hits: int
    tokens: list[list[int]]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def summary(self) -> dict:
        ttft = sorted(self.ttft_s)
        return {"prefix_caching": self.prefix_caching, "ttft_mean_s": statistics.fmean(ttft),
                "ttft_p50_s": statistics.median(ttft), "ttft_max_s": ttft[-1], "wall_s": self.wall_s,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits, "hit_rate": self.hit_rate}


def make_prompts(candidates: np.ndarray, requests: int, prefix_tokens: int, suffix_tokens: int,
                 seed: int = 0) -> tuple[list[int], list[list[int]]]:
    """(warm-up prompt, the requests' prompts): one shared prefix, distinct suffixes."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> list[int]:
        return [int(i) for i in rng.choice(candidates, size=n)]

    prefix = draw(prefix_tokens)
    return draw(prefix_tokens + suffix_tokens), [prefix + draw(suffix_tokens) for _ in range(requests)]


def run_side(g, prompts: list[list[int]], warmup: list[int], caching: bool, args) -> SideResult:
    import torch

    from splitmoe.attention_service.expert_backends.backend import InProcessExperts
    from splitmoe.attention_service.model.runner import DTYPES, RunnerOptions
    from splitmoe.attention_service.service import load_serving_model
    from splitmoe.attention_service.settings import AttentionSettings

    kv_tokens = (len(prompts) + 1) * (len(prompts[0]) + args.max_tokens) + 256
    settings = AttentionSettings(
        model_path=str(g.path), max_batch_tokens=args.max_batch_tokens,
        runner=RunnerOptions(dtype=DTYPES[args.dtype], device=torch.device("cpu"), kv_cache_tokens=kv_tokens,
                             prefix_caching=caching))
    model = load_serving_model(settings, experts=InProcessExperts(g))
    model.engine.start()
    try:
        generate(model, [warmup], args.max_tokens)
        stats = model.runner.blocks.prefix_stats
        queries, hits = stats.queries, stats.hits
        started = time.perf_counter()
        ttft, tokens = generate(model, prompts, args.max_tokens)
        wall_s = time.perf_counter() - started
        return SideResult(caching, ttft, wall_s, stats.queries - queries, stats.hits - hits, tokens)
    finally:
        model.engine.stop()


def generate(model, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """Submit every prompt at once; each one's time to first token and its tokens."""
    from splitmoe.attention_service.engine.sampling import SamplingOptions

    first_s: list[float | None] = [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    errors: list[str] = []
    done = threading.Semaphore(0)

    def sink_for(i: int):
        def sink(out) -> None:
            if first_s[i] is None:
                first_s[i] = time.perf_counter()
            tokens[i].extend(t.token_id for t in out.tokens)
            errors.extend([out.error] if out.error else [])
            if out.finished:
                done.release()
        return sink

    options = SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    start_s = time.perf_counter()
    for i, ids in enumerate(prompts):
        model.engine.submit(model.new_request(f"prefix-bench-{i}", ids, options, sink_for(i)))
    for _ in prompts:
        done.acquire()
    if errors:
        raise RuntimeError(f"engine: {errors[0]}")
    return [s - start_s for s in first_s], tokens


def report(on: SideResult, off: SideResult) -> str:
    a, b = on.summary(), off.summary()
    same = sum(x == y for x, y in zip(on.tokens, off.tokens))
    rows = [("", "caching on", "caching off", "off / on")]
    for key, label in (("ttft_mean_s", "TTFT mean, s"), ("ttft_p50_s", "TTFT p50, s"), ("ttft_max_s", "TTFT max, s"),
                       ("wall_s", "all requests done, s")):
        rows.append((label, f"{a[key]:.2f}", f"{b[key]:.2f}", f"{b[key] / a[key]:.2f}x"))
    rows.append(("prefix cache hit rate", f"{100 * on.hit_rate:.1f}% ({on.hits}/{on.queries} tokens)", "-", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + f"\nrequests generating the same tokens on both sides: {same} of {len(on.tokens)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m splitmoe.bench.prefix_cache", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--threads", type=int, default=0, help="torch and native threads (0: torch's choice)")
    p.add_argument("--requests", type=int, default=16, help="requests arriving together")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="their common prefix (the system prompt)")
    p.add_argument("--suffix-tokens", type=int, default=16, help="each one's own suffix")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens each generates")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (the service's default)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the serving default")
    p.add_argument("--json", default="", help="also write the figures here")
    args = p.parse_args(argv)

    import torch

    from splitmoe.bench.workload import normal_token_ids
    from splitmoe.kernels import native
    from splitmoe.kernels.cpu_features import describe
    from splitmoe.modelfile.gguf_file import GGUFFile

    if args.threads:
        native.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    g = GGUFFile(args.model)
    vocab = g.metadata.get("tokenizer.ggml.tokens") or []
    candidates = normal_token_ids(g.metadata.get("tokenizer.ggml.token_type"), len(vocab))
    warmup, prompts = make_prompts(candidates, args.requests, args.prefix_tokens, args.suffix_tokens)
    on = run_side(g, prompts, warmup, True, args)
    off = run_side(g, prompts, warmup, False, args)
    print(f"{args.model}: {args.requests} requests, {args.prefix_tokens}-token common prefix + "
          f"{args.suffix_tokens} tokens each, {args.max_tokens} generated, {args.dtype}, "
          f"{torch.get_num_threads()} threads\n{describe()}\n{report(on, off)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "on": on.summary(), "off": off.summary(),
                       "on_raw": asdict(on), "off_raw": asdict(off)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
