"""`splitmoe vram [MODEL.gguf | --shape NAME]`: the GPU memory the attention service needs for a
model (non-expert weights dense, KV cache, workspace), from its hyper-parameters: known before a
card is bought. With neither a file nor a shape, every shape users ask about."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vram", help="estimate the attention service's GPU memory for a GGUF file or a known shape")
    p.add_argument("model", nargs="?", help="a GGUF file (only its metadata and tensor names are read)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME",
                   help="a released model's shape: gpt-oss-120b, qwen3-235b-a22b or deepseek-v3 (repeatable; "
                        "default: all of them when no file is given)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="the weights' and KV cache's dtype on the GPU")
    p.add_argument("--kv-cache-tokens", type=int, default=16384,
                   help="KV cache capacity in tokens, as serve-attention's flag")
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="tokens per step, as serve-attention's flag (sizes the workspace)")
    p.add_argument("--max-running", type=int, default=64,
                   help="sequences decoding together, as serve-attention's flag (sizes the logits)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from splitmoe.attention_service.gpu.vram import SHAPES, ServingSizes, estimate_file, format_table
    from splitmoe.attention_service.model.runner import DTYPES
    from splitmoe.modelfile.gguf_file import GGUFFile

    unknown = [s for s in args.shape if s not in SHAPES]
    if unknown:
        raise ValueError(f"--shape {unknown[0]!r}: want one of {', '.join(SHAPES)}")
    sizes = ServingSizes(dtype=DTYPES[args.dtype], kv_cache_tokens=args.kv_cache_tokens,
                         max_batch_tokens=args.max_batch_tokens, max_running_seqs=args.max_running)
    shapes = args.shape or ([] if args.model else list(SHAPES))
    rows = {name: SHAPES[name].estimate(sizes) for name in shapes}
    if args.model:
        g = GGUFFile(args.model)
        rows[g.path.name] = estimate_file(g, sizes)
    print(format_table(rows, sizes))
    print(f"{args.dtype} weights and KV cache; workspace: a step of {args.max_batch_tokens} prompt tokens; graphs: "
          f"a decode step of {min(args.max_running, args.max_batch_tokens)} sequences. Not counted: the CUDA context "
          "(a few hundred MiB), fragmentation.")
    return 0
