"""`splitmoe serve-attention`: the attention service (gRPC), with experts in-process or remote."""
from __future__ import annotations

import argparse

from splitmoe.commands.cluster_flags import add_cluster_flags, cluster_security


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


# The options that shape what the attention service serves and how: `serve-attention` takes them,
# and `up` takes the same ones and hands them to the attention service it starts. Defined once,
# so the two never disagree on a name or a default.
SERVING_OPTIONS: tuple[tuple[str, dict], ...] = (
    ("--served-model-name", dict(default="", help="the model id clients send and /v1/models lists "
                                                  "(default: the GGUF file's stem)")),
    ("--dtype", dict(choices=["float32", "bfloat16"], default="bfloat16",
                     help="bfloat16: the fast path (quantized kernels, float32 residual stream and router); "
                          "float32: the exact reference path (dequantized weights, slowest)")),
    ("--device", dict(default="", help="torch device for attention (default: cuda when present, else cpu)")),
    ("--kv-cache-tokens", dict(type=int, default=16384, help="KV cache capacity in tokens, over all sequences")),
    ("--kv-cache-dtype", dict(choices=["auto", "bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "q8_0"], default="auto",
                              help="how the KV cache stores values: auto as computed (--dtype), or 8 bits a value: "
                                   "fp8 (vLLM's, scale 1.0) or q8_0 (llama.cpp's 32-value blocks): twice the tokens "
                                   "in the same memory (default: auto)")),
    ("--max-batch-tokens", dict(type=int, default=512, help="tokens per step (prompt chunks + decodes)")),
    ("--max-running", dict(type=int, default=64, help="sequences decoding together")),
    ("--max-waiting", dict(type=int, default=256, help="queued requests before 429")),
    ("--local-experts", dict(type=int, default=0, metavar="N",
                             help="keep the first N MoE layers' experts in this process (like llama.cpp "
                                  "--n-cpu-moe)")),
    ("--local-experts-by-heat", dict(default="", metavar="N|SIZE",
                                     help="keep the hottest routed experts, by measured tokens per second, in this "
                                          "process: N (layer, expert) pairs, or SIZE of their weights (512M, 2G). "
                                          "The heat comes from --heat-file at start, then from the traffic at "
                                          "each rebalance (default: none)")),
    ("--heat-file", dict(default="", metavar="PATH",
                         help="the measured heat per (layer, expert): read at start (the first placement follows "
                              "the previous run's traffic), written at every rebalance and at shutdown (default: none)")),
    ("--heat-half-life-s", dict(type=float, default=60.0,
                                help="half-life of the decayed tokens-per-second rate the placement follows")),
    ("--rebalance-spare-slots", dict(type=int, default=1, metavar="N",
                                     help="per expert service and layer, experts it may host beyond an even "
                                          "share: replicas of the hottest experts when rebalancing")),
    ("--auto-rebalance", dict(type=float, default=0.0, metavar="RATIO",
                              help="rebalance by itself when the measured imbalance (max over mean tokens per "
                                   "expert service per layer call) passes RATIO, e.g. 1.3 (0: only on "
                                   "`splitmoe rebalance`)")),
    ("--auto-rebalance-interval-s", dict(type=float, default=30.0,
                                         help="how often the measured imbalance is checked")),
    ("--expert-resolve-interval-s", dict(type=float, default=1.0, metavar="S",
                                         help="resolve the names of --expert-services again this often while "
                                              "serving: a new address (compose --scale, kubectl scale, a pod "
                                              "moved) joins with a share of the experts, one gone leaves after "
                                              "its experts moved (0: resolve at start only)")),
    ("--expert-hosts-file", dict(default="", metavar="PATH",
                                 help="an /etc/hosts-style file read at every resolution, before DNS: edit it to "
                                      "add or remove expert services where no DNS can be changed (default: none)")),
    ("--transport", dict(choices=["auto", "grpc", "shm"], default="auto",
                         help="auto: shared memory to expert services on this host, gRPC to the others")),
    ("--expert-timeout-s", dict(type=float, default=30.0, help="deadline of every expert hop, in seconds")),
    ("--expert-keepalive-s", dict(type=float, default=0.5,
                                  help="gRPC ping interval to each expert service, and how long its answer may "
                                       "take: a silent host is found within about twice this")),
    ("--hedge-after-s", dict(type=float, default=0.25,
                             help="a hop is re-sent to a replica no sooner than this, nor before 4x its service's "
                                  "learned 99th percentile (see docs/operate.md, faults across hosts)")),
    ("--experts-per-token", dict(type=int, default=0, metavar="K",
                                 help="routed experts per token (0: the model's own); requests may override it")),
    ("--reasoning-format", dict(choices=["auto", "none"], default="auto",
                                help="auto: chat replies return the model's reasoning apart from the content "
                                     "(harmony or <think> tags, found in the vocabulary); none: reasoning stays "
                                     "inline in the content")),
    ("--prefix-caching", dict(choices=["on", "off"], default="on",
                              help="on: requests reuse the KV of full blocks an earlier request with the same "
                                   "tokens before them computed (a shared system prompt is prefilled once), "
                                   "least recently used evicted first; off: every prompt is computed whole")),
    ("--tool-call-parser", dict(choices=["auto", "hermes", "deepseek", "kimi_k2", "mistral", "harmony", "glm45", "none"],
                                default="auto",
                                help="how chat replies' tool calls are read: auto picks the model's syntax from "
                                     "its vocabulary and chat template (hermes when none is recognised); none: "
                                     "tool_choice auto returns the text as content")),
    ("--cuda-graphs", dict(choices=["on", "off"], default="on",
                           help="on a CUDA device: decode steps replay CUDA graphs of the work between two "
                                "expert hops, captured per batch and context bucket at first use; off: the same "
                                "kernels launched one by one (same outputs, slower)")),
    ("--gpu-experts", dict(default="", metavar="N|SIZE",
                           help="on a CUDA device: keep N routed (layer, expert) pairs, or SIZE of them (4G), in GPU "
                                "memory (bfloat16): the hottest by --heat-file's rates, else whole MoE layers from "
                                "the first; the rest stay on the expert services (default: none)")),
    ("--speculative", dict(choices=["none", "ngram", "draft", "mtp"], default="none",
                           help="speculative decoding: ngram drafts each stream's next tokens from its own "
                                "prompt and output (prompt lookup), draft from --model-draft's greedy decoding, "
                                "mtp with the file's own NextN/MTP block (GLM-4.5, GLM-4.7-Flash; its experts on "
                                "the expert services with the others); "
                                "they are verified all at once in one step, one hop per "
                                "layer for all of them; greedy output is exactly what decoding one token at a time "
                                "gives, sampled output is distributed as it (rejection sampling). Requests with a "
                                "grammar decode as before")),
    ("--model-draft", dict(default="", metavar="FILE",
                           help="with --speculative draft: a small GGUF with the same vocabulary, run whole in "
                                "the attention process with a KV cache of its own, as llama-server runs it (default: none)")),
    ("--num-speculative-tokens", dict(type=int, default=4, metavar="K",
                                      help="drafted tokens per step and stream, with --speculative")),
    ("--lora-modules", dict(nargs="+", default=[], metavar="NAME=PATH",
                            help="LoRA adapters served beside the base model, GGUF files as llama.cpp's "
                                 "convert_lora_to_gguf.py writes them: a request's `model` NAME picks one, "
                                 "/v1/models lists them; more at run time with /v1/load_lora_adapter (default: none)")),
    ("--max-loras", dict(type=int, default=4, help="LoRA adapters loaded at once")),
    ("--max-lora-rank", dict(type=int, default=64, help="the largest rank an adapter's tensor may have")),
    ("--micro-batches", dict(type=int, choices=[1, 2], default=1,
                             help="2: cut each step of several sequences in two and pipeline the halves, so "
                                  "that attention of one overlaps the remote experts of the other "
                                  "(MegaScale-Infer's ping-pong); pays where halving a batch halves its cost on "
                                  "both sides (large batches), costs where decode is bound by weight reads")),
)


def add_serving_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("attention service")
    for flag, kwargs in SERVING_OPTIONS:
        group.add_argument(flag, **kwargs)


def serving_options_argv(args: argparse.Namespace) -> list[str]:
    """The serving options set to other than their defaults, as `serve-attention` arguments."""
    argv = []
    for flag, kwargs in SERVING_OPTIONS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value != kwargs["default"]:
            argv += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return argv


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-attention", help="run the attention service (gRPC)")
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model, trained to answer simple questions)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--expert-services", type=_addresses, default=(),
                   help="host:port,... of expert services (default: none, all experts in-process)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    p.add_argument("--pin-threads", action="store_true",
                   help="each compute thread on its own CPU, in the order of the CPUs the process may use "
                        "(the engine on the first): what `splitmoe up` passes where the expert services "
                        "share these cores and pin theirs in the same order")
    add_serving_options(p)
    add_cluster_flags(p, serves=True, calls=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import torch

    from splitmoe.attention_service.engine.speculation import SpeculationSettings
    from splitmoe.attention_service.expert_backends.load_plan import HeatBudget
    from splitmoe.attention_service.expert_backends.remote import RemoteExpertsSettings
    from splitmoe.attention_service.lora_adapters import parse_lora_module
    from splitmoe.attention_service.model.runner import DTYPES, default_device
    from splitmoe.attention_service.server import serve
    from splitmoe.attention_service.settings import AttentionSettings, serving_runner_options
    from splitmoe.runtime.settings import otlp_endpoint, setup_logging
    from splitmoe.runtime.telemetry import setup_tracing

    if args.model is None:
        from splitmoe.demo import trained_model_path

        args.model = str(trained_model_path())
    security = cluster_security(args)
    runner = serving_runner_options(
        dtype=DTYPES[args.dtype], device=torch.device(args.device) if args.device else default_device(),
        kv_cache_tokens=args.kv_cache_tokens, kv_cache_dtype=args.kv_cache_dtype,
        experts_per_token=args.experts_per_token, micro_batches=args.micro_batches,
        prefix_caching=args.prefix_caching == "on", cuda_graphs=args.cuda_graphs == "on")
    experts = RemoteExpertsSettings(
        addresses=args.expert_services, expert_timeout_s=args.expert_timeout_s, transport=args.transport,
        keepalive_s=args.expert_keepalive_s, hedge_floor_s=args.hedge_after_s,
        local_layers=args.local_experts, local_by_heat=HeatBudget.parse(args.local_experts_by_heat or "0"),
        heat_file=args.heat_file, heat_half_life_s=args.heat_half_life_s,
        rebalance_spare_slots=args.rebalance_spare_slots, auto_rebalance_imbalance=args.auto_rebalance,
        auto_rebalance_interval_s=args.auto_rebalance_interval_s, resolve_interval_s=args.expert_resolve_interval_s,
        hosts_file=args.expert_hosts_file, security=security) if args.expert_services else None
    settings = AttentionSettings(
        model_path=args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
        runner=runner, experts=experts, max_batch_tokens=args.max_batch_tokens, max_running_seqs=args.max_running,
        max_waiting_requests=args.max_waiting, otlp_endpoint=otlp_endpoint(), reasoning_format=args.reasoning_format,
        tool_call_parser=args.tool_call_parser, security=security,
        gpu_experts=HeatBudget.parse(args.gpu_experts or "0", "--gpu-experts"),
        speculation=SpeculationSettings(args.speculative, args.num_speculative_tokens,
                                        draft_model=args.model_draft),
        lora_modules=tuple(parse_lora_module(m) for m in args.lora_modules), max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank)
    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.pin_threads:
        from splitmoe.kernels import native
        from splitmoe.runtime.topology import compute_cpus

        native.pin_compute(compute_cpus(torch.get_num_threads()))
    setup_tracing("splitmoe-attention", settings.otlp_endpoint)
    logging.getLogger(__name__).info("starting attention service for %s (%s)", settings.model_path, args.dtype)
    asyncio.run(serve(settings, freeze_heap=True))
    return 0
