"""Decode speed by KV cache format (`--kv-cache-dtype`) at long contexts: issue 31's speed table.

In-process (the model runner and all experts in this process), the fast mode (bfloat16), for each
context length and number of streams: every stream's context is put in the cache directly (random
keys and values of a trained model's scale, written through the cache's own format) instead of
prefilling it, which would take minutes at 16 x 16k tokens and measures something else; then each
format decodes the same number of steps, one new token a stream a step. Decode time at a long
context is mostly the attention reading the cache, which is what the formats change.

    python -m splitmoe.bench.kv_bench --model q3_6l.gguf --contexts 512 4096 16384 --streams 1 16

Prints a table (tok/s, and each 8-bit format against bfloat16 at the same point) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.modelfile.gguf_file import GGUFFile

FORMATS = ("auto", "q8_0", "fp8_e4m3")


def fill_context(runner: ModelRunner, seqs: list[Sequence], context_tokens: int, seed: int) -> None:
    """Each sequence's first `context_tokens` positions in the cache, as if prefilled."""
    gen = torch.Generator().manual_seed(seed)
    shapes = runner.model.kv_entry_shapes()
    for s in seqs:
        runner.blocks.reserve(s.seq_id, context_tokens)
        slots = runner.blocks.slots(s.seq_id, 0, context_tokens)
        for layer in range(runner.cfg.num_layers):
            # keys after rope and q/k norm are of order 1-3 per value, values of order 1
            entries = {name: torch.randn(context_tokens, *shape, generator=gen) * (2.0 if name == "k" else 1.0)
                       for name, shape in shapes.items()}
            runner.kv.write(layer, slots, **entries)
        s.num_cached_tokens = context_tokens


def decode_rate(model: str, fmt: str, context_tokens: int, streams: int, steps: int) -> float:
    """Tokens a second over `steps` decode steps of `streams` sequences at `context_tokens`."""
    kv_tokens = streams * (context_tokens + steps + 32)
    runner = ModelRunner.from_gguf(model, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                        kv_cache_tokens=kv_tokens, kv_cache_dtype=fmt,
                                                        prefix_caching=False))
    vocab = runner.cfg.vocab_size
    seqs = [Sequence(i, [(7 * j + 3 * i + 1) % vocab for j in range(context_tokens + 1)]) for i in range(streams)]
    fill_context(runner, seqs, context_tokens, seed=context_tokens + streams)
    with torch.inference_mode():
        for warm in (True, False):
            start = time.perf_counter()
            for _ in range(2 if warm else steps):
                logits = runner.step(seqs, [1] * streams)
                for s, t in zip(seqs, logits.argmax(-1).tolist()):
                    s.token_ids.append(t)
            elapsed = time.perf_counter() - start
    return streams * steps / elapsed


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 16384])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    p.add_argument("--formats", nargs="+", default=list(FORMATS))
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per point")
    p.add_argument("--threads", type=int, default=0, help="native and torch threads (0: the library's default)")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    a = p.parse_args(argv)
    if a.threads:
        native.set_num_threads(a.threads)
        torch.set_num_threads(a.threads)
    name = GGUFFile(a.model).path.name
    rows = []
    for streams in a.streams:
        for ctx in a.contexts:
            rates = {fmt: decode_rate(a.model, fmt, ctx, streams, a.steps) for fmt in a.formats}
            rows.append({"streams": streams, "context_tokens": ctx, "tok_s": rates})
            print(f"streams {streams:3d} context {ctx:6d}: " +
                  "  ".join(f"{f} {r:7.1f}" for f, r in rates.items()), flush=True)
    print(f"\n{name}, {native.get_num_threads()} threads, {native.isa()}, {platform.processor() or platform.machine()}")
    print("| streams | context | " + " | ".join(f"{f} tok/s" for f in a.formats) + " | " +
          " | ".join(f"{f} / bf16" for f in a.formats if f != "auto") + " |")
    print("|---|---|" + "---|" * (2 * len(a.formats) - 1))
    for r in rows:
        base = r["tok_s"].get("auto")
        ratios = [f"{r['tok_s'][f] / base:.2f}x" if base else "" for f in a.formats if f != "auto"]
        print(f"| {r['streams']} | {r['context_tokens']} | " + " | ".join(f"{r['tok_s'][f]:.1f}" for f in a.formats)
              + " | " + " | ".join(ratios) + " |")
    if a.out:
        a.out.write_text(json.dumps({"model": name, "threads": native.get_num_threads(), "isa": native.isa(),
                                     "steps": a.steps, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
