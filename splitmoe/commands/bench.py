"""`splitmoe bench make-model`: write a GGUF of a real MoE shape with random weights, for benchmarks.

Reproducible (the same seed gives the same bytes) and made without llama.cpp; only the first
`--layers` layers of the real model, in a llama.cpp quantization mix.
"""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark tooling")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    m = bench_sub.add_parser("make-model", help="write a realistic-shape GGUF with random weights")
    m.add_argument("--shape", required=True, choices=["qwen3-30b-a3b", "olmoe-1b-7b"])
    m.add_argument("--layers", type=int, required=True, help="how many of the real model's layers to write")
    m.add_argument("--quant", default="q4_k_m", choices=["q4_k_m", "q4_0", "q8_0"])
    m.add_argument("--out", required=True, help="the GGUF file to write")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--vocab", type=int, default=0, help="override the shape's vocabulary size (small test files)")
    m.set_defaults(run=run_make_model)


def run_make_model(args: argparse.Namespace) -> int:
    import time

    from bench.make_model import write_model

    start = time.perf_counter()
    path = write_model(args.out, args.shape, args.layers, args.quant, args.seed, args.vocab or None)
    size = path.stat().st_size
    print(f"{path}: {args.shape}, {args.layers} layers, {args.quant}, seed {args.seed}: "
          f"{size / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
    return 0
