"""What a LoRA adapter costs: prefill and decode with and without one, and with a batch that mixes them.

In-process (the model runner and all experts in this process), the fast mode (bfloat16). The adapter is
made here for the file's shapes, in llama.cpp's adapter layout (`convert_lora_to_gguf.py`'s keys and
`.lora_a` / `.lora_b` pairs): rank `--rank` on the attention's q, k, v and output ("attn"), on every
routed expert's gate, up and down ("experts"), or both. Random numbers: speed does not depend on them.

    python -m splitmoe.bench.lora_bench --model q3_6l.gguf

Prints a table (tok/s, and each adapter against the base at the same point) and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from splitmoe.attention_service.model.lora import AdapterWeights
from splitmoe.attention_service.model.runner import ModelRunner, RunnerOptions
from splitmoe.attention_service.model.sequence import Sequence
from splitmoe.kernels import native
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.lora_adapter import load_lora_adapter

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def write_adapter(base: GGUFFile, path: Path, rank: int, targets: tuple[str, ...], seed: int = 0,
                  b_std: float = 0.01) -> None:
    """An adapter of rank `rank` on every base tensor `blk.N.<target>.weight`, scale 1 (alpha = rank):
    A of unit-norm rows' scale, B of `b_std`."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), base.arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(rank))
    for name in base.tensor_names:
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in targets or parts[3] != "weight":
            continue
        shape = tuple(base.tensor(name).shape)  # [out, in] or [E, out, in], torch order
        *experts, out, inp = shape
        a = (rng.standard_normal((*experts, rank, inp)) / np.sqrt(inp)).astype(np.float32)
        b = (rng.standard_normal((*experts, out, rank)) * b_std).astype(np.float32)
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def timed(fn, repeat: int) -> float:
    fn()  # warm: first-call allocations and caches
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def measure(runner: ModelRunner, lora: AdapterWeights | None, streams: int, mixed: bool, prompt_tokens: int,
            steps: int) -> dict[str, float]:
    """Prefill of one `prompt_tokens` prompt a stream (tok/s), then decode of `steps` tokens a stream.
    `mixed`: every other stream on the base model."""
    vocab = runner.cfg.vocab_size
    next_id = iter(range(1, 1 << 30))

    def new_seqs() -> list[Sequence]:
        return [Sequence(next(next_id), [(7 * j + 13 * i + 1) % vocab for j in range(prompt_tokens)],
                         lora=None if (mixed and i % 2) else lora) for i in range(streams)]

    def prefill() -> None:
        seqs = new_seqs()
        runner.step(seqs)
        for s in seqs:
            runner.release(s)

    with torch.inference_mode():
        prefill_s = timed(prefill, 1 if streams > 1 else 2)
        seqs = new_seqs()
        runner.step(seqs)
        for s in seqs:
            s.token_ids.extend([5] * (steps + 2))

        def decode_one() -> None:
            runner.step(seqs, [1] * streams)

        decode_s = timed(decode_one, steps)
        for s in seqs:
            runner.release(s)
    return {"prefill_tok_s": streams * prompt_tokens / prefill_s, "decode_tok_s": streams / decode_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="bench/results-lora.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = GGUFFile(args.model)
    runner = ModelRunner.from_gguf(base, RunnerOptions(dtype=torch.bfloat16, device=torch.device("cpu"),
                                                       kv_cache_tokens=max(args.streams) * (args.prompt_tokens + args.steps + 64),
                                                       prefix_caching=False))
    adapters: dict[str, AdapterWeights | None] = {"base": None}
    with tempfile.TemporaryDirectory() as tmp:
        for name, targets in (("attn", ATTENTION), ("experts", EXPERTS), ("both", ATTENTION + EXPERTS)):
            path = Path(tmp) / f"{name}.gguf"
            write_adapter(base, path, args.rank, targets)
            adapters[name] = AdapterWeights.of(load_lora_adapter(path, base, name))
    rows = []
    for streams in args.streams:
        for name, lora in adapters.items():
            for mixed in ((False, True) if streams > 1 and lora is not None else (False,)):
                got = measure(runner, lora, streams, mixed, args.prompt_tokens, args.steps)
                rows.append({"streams": streams, "adapter": name, "mixed_with_base": mixed, **got})
                print(rows[-1], flush=True)
    for row in rows:
        ref = next(r for r in rows if r["streams"] == row["streams"] and r["adapter"] == "base")
        row["prefill_vs_base"] = row["prefill_tok_s"] / ref["prefill_tok_s"]
        row["decode_vs_base"] = row["decode_tok_s"] / ref["decode_tok_s"]
    print(f"\n{'streams':>7} {'adapter':<14} {'prefill tok/s':>13} {'x base':>6} {'decode tok/s':>12} {'x base':>6}")
    for r in rows:
        label = r["adapter"] + (" (half)" if r["mixed_with_base"] else "")
        print(f"{r['streams']:>7} {label:<14} {r['prefill_tok_s']:>13.1f} {r['prefill_vs_base']:>6.2f} "
              f"{r['decode_tok_s']:>12.1f} {r['decode_vs_base']:>6.2f}")
    report = {"model": Path(args.model).name, "rank": args.rank, "prompt_tokens": args.prompt_tokens,
              "steps": args.steps, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "isa": native._best_isa() if native.AVAILABLE else "none", "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
