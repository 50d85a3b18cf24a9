"""`splitmoe bench`: benchmark tooling.

`make-model` writes a GGUF of a real MoE shape with random weights: reproducible (the same seed
gives the same bytes) and made without llama.cpp; only the first `--layers` layers of the real
model (Qwen3, OLMoE, gpt-oss-120b, DeepSeek-V3), in a llama.cpp quantization mix or one after
Unsloth's dynamic DeepSeek quants.

`run` measures prefill, time to first token, single-stream and concurrent decode and the per-hop
overhead through the real services, the same engine in-process, and optionally its peers on the
same file and threads: `--baseline llama.cpp` (llama-cpp-python, the `bench` extra, or a build's own
tools with `--llama-cpp-dir`) and `--baseline ik_llama.cpp` (a build's tools, `--ik-llama-cpp-dir`);
see bench/run.py.
"""
from __future__ import annotations

import argparse
import sys

from splitmoe.runtime import settings


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark tooling")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    m = bench_sub.add_parser("make-model", help="write a realistic-shape GGUF with random weights")
    m.add_argument("--shape", required=True,
                   choices=["qwen3-30b-a3b", "qwen3-235b-a22b", "olmoe-1b-7b", "gpt-oss-120b", "deepseek-v3"],
                   help="the real model whose dimensions the file takes")
    m.add_argument("--layers", type=int, required=True, help="how many of the real model's layers to write")
    m.add_argument("--quant", default="q4_k_m", choices=["q4_k_m", "q4_0", "q8_0", "mxfp4_moe", "ud_iq1_s"],
                   help="tensor types: q4_k_m is llama.cpp's mix (Q4_K, Q6_K for some); mxfp4_moe is "
                        "llama-quantize's MXFP4_MOE (MXFP4 experts, Q8_0 otherwise: gpt-oss as released); ud_iq1_s "
                        "is after Unsloth's DeepSeek-R1-UD-IQ1_S (IQ1_S/IQ2_XXS/IQ3_XXS experts, Q4_K/Q6_K otherwise)")
    m.add_argument("--out", required=True, help="the GGUF file to write")
    m.add_argument("--seed", type=int, default=0, help="picks the random weights")
    m.add_argument("--vocab", type=int, default=0, help="override the shape's vocabulary size (small test files)")
    m.add_argument("--dense-layers", type=int, default=None, metavar="N",
                   help="leading dense layers, for shapes that have them (deepseek-v3: the real model has 3; "
                        "default 1, so that a file of a few layers is mostly MoE layers)")
    m.add_argument("--experts", type=int, default=0, metavar="E",
                   help="fewer routed experts than the real model (small test files; widths stay real)")
    m.add_argument("--nextn", type=int, default=0, metavar="N",
                   help="NextN/MTP blocks after the layers (as GLM-4.5 files carry one), for --speculative mtp")
    m.set_defaults(run=run_make_model)

    r = bench_sub.add_parser("run", help="measure the services, in-process and (optionally) the peers on one file")
    r.add_argument("--model", required=True, help="the GGUF file (e.g. from `splitmoe bench make-model`)")
    r.add_argument("--threads", type=int, default=0, metavar="T",
                   help="CPU threads (default: the CPUs this process may use): the expert services split T, the "
                        "attention service gets T (the two sides take turns); in-process and llama.cpp use T")
    r.add_argument("--json", default="", metavar="OUT", help="also write every figure to this JSON file (default: none)")
    r.add_argument("--plot", default="", metavar="PNG",
                   help="also decode at 2, 4 and 8 streams and draw tok/s against streams for every engine "
                        "(default: no plot)")
    r.add_argument("--baseline", action="append", default=[], choices=["none", "llama.cpp", "ik_llama.cpp"],
                   help="a peer to run on the same file and threads; repeat for both (default: none). llama.cpp "
                        "runs through llama-cpp-python (`pip install 'splitmoe[bench]'`) unless --llama-cpp-dir "
                        "is given; ik_llama.cpp needs --ik-llama-cpp-dir")
    r.add_argument("--llama-cpp-dir", default=settings.llama_cpp_bin_dir(), metavar="DIR",
                   help="a llama.cpp build's bin directory: --baseline llama.cpp runs its llama-bench and "
                        f"llama-batched-bench instead of llama-cpp-python (default: ${settings.LLAMA_CPP_BIN_ENV})")
    r.add_argument("--ik-llama-cpp-dir", default=settings.ik_llama_cpp_bin_dir(), metavar="DIR",
                   help="an ik_llama.cpp build's bin directory, for --baseline ik_llama.cpp: its llama-bench and "
                        "llama-batched-bench, each with -rtr 0 and 1, the better counting "
                        f"(default: ${settings.IK_LLAMA_CPP_BIN_ENV})")
    r.add_argument("--prompt-tokens", type=int, default=512, help="prefill / time-to-first-token prompt length")
    r.add_argument("--decode-tokens", type=int, default=128, help="tokens generated per stream")
    r.add_argument("--streams", type=int, default=16, help="concurrent streams of the aggregate decode")
    r.add_argument("--stream-prompt-tokens", type=int, default=16, help="each concurrent stream's prompt length")
    r.add_argument("--seed", type=int, default=0, help="picks the prompts' token ids")
    r.add_argument("--expert-services", type=int, default=None, metavar="N",
                   help="expert service processes (0: the attention service computes the experts itself; default: "
                        "one per NUMA node, as the services are meant to run)")
    r.add_argument("--transport", default="auto", choices=["auto", "grpc", "shm"],
                   help="the attention service's transport to its expert services")
    r.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the attention side's dtype (float32 is the exact reference path)")
    r.add_argument("--attention-device", default="cpu", choices=["cpu", "cuda"],
                   help="where the attention service runs attention: cpu (default) or cuda (the first GPU); the "
                        "expert services and the in-process run stay on the CPU")
    r.add_argument("--omp-wait-policy", default="PASSIVE", choices=["PASSIVE", "ACTIVE", "default"],
                   help="OMP_WAIT_POLICY of the service processes: PASSIVE (default) puts waiting OpenMP threads to "
                        "sleep, so the side that waits leaves the cores to the side that computes")
    r.add_argument("--no-pin-threads", dest="pin_threads", action="store_false",
                   help="leave the services' threads to the scheduler, as `splitmoe up --no-pin-threads` does")
    r.add_argument("--no-inprocess", dest="inprocess", action="store_false", help="skip the in-process run")
    r.add_argument("--bandwidth-mb", type=int, default=1024, help="buffer of the memory-bandwidth measurement")
    r.add_argument("--run-dir", default="", help="where the services' logs go (default: a new directory under "
                                                 "~/.cache/splitmoe/runs/)")
    r.set_defaults(run=run_bench)


def run_make_model(args: argparse.Namespace) -> int:
    import time

    from splitmoe.bench.make_model import write_model

    start = time.perf_counter()
    path = write_model(args.out, args.shape, args.layers, args.quant, args.seed, args.vocab or None,
                       args.dense_layers, args.experts or None, args.nextn)
    size = path.stat().st_size
    print(f"{path}: {args.shape}, {args.layers} layers, {args.quant}, seed {args.seed}: "
          f"{size / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from splitmoe.bench.report import context_lines, table
    from splitmoe.bench.run import BenchSettings, write_json
    from splitmoe.bench.run import run_bench as bench
    from splitmoe.bench.workload import Workload
    from splitmoe.runtime.topology import numa_nodes, usable_cpus
    from splitmoe.supervisor import ServiceFailed

    sweep = tuple(n for n in (2, 4, 8) if n < args.streams) if args.plot else ()
    workload = Workload(prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens, streams=args.streams,
                        stream_prompt_tokens=args.stream_prompt_tokens, seed=args.seed, sweep=sweep)
    settings = BenchSettings(
        model_path=args.model, threads=args.threads or usable_cpus(), workload=workload,
        baselines=tuple(args.baseline), llama_cpp_dir=args.llama_cpp_dir, ik_llama_cpp_dir=args.ik_llama_cpp_dir,
        expert_services=numa_nodes() if args.expert_services is None else args.expert_services,
        transport=args.transport, dtype=args.dtype, attention_device=args.attention_device,
        omp_wait_policy="" if args.omp_wait_policy == "default" else args.omp_wait_policy,
        pin_threads=args.pin_threads, inprocess=args.inprocess, bandwidth_mb=args.bandwidth_mb, run_dir=args.run_dir)
    try:
        figures = bench(settings, say=lambda line: print(line, flush=True))
    except (ServiceFailed, RuntimeError) as e:  # a service, the in-process engine or the llama.cpp child failed
        print(f"splitmoe bench run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("splitmoe bench run: interrupted", file=sys.stderr)
        return 130
    print()
    print(table(figures))
    print()
    for line in context_lines(figures):
        print(line)
    print(f"command: {figures['command']}  ({figures['wall_s']:.0f} s)")
    if args.json:
        write_json(figures, args.json)
        print(f"figures: {args.json}")
    if args.plot:
        from splitmoe.bench.plot import plot_decode_curve

        print(f"plot: {plot_decode_curve(figures, args.plot)}")
    return 0
