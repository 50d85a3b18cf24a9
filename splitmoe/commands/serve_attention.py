"""`splitmoe serve-attention`: the attention service (gRPC), with experts in-process or remote."""
from __future__ import annotations

import argparse

from splitmoe.commands.cluster_flags import add_cluster_flags, cluster_security


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-attention", help="run the attention service (gRPC)")
    p.add_argument("model", nargs="?", help="GGUF file (default: the built-in demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--served-model-name", default="")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--device", default="", help="default: cuda when present, else cpu")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (prompt chunks + decodes)")
    p.add_argument("--max-running", type=int, default=64, help="sequences decoding together")
    p.add_argument("--max-waiting", type=int, default=256, help="queued requests before 429")
    p.add_argument("--expert-services", type=_addresses, default=(),
                   help="host:port,... of expert services (default: all experts in-process)")
    p.add_argument("--local-experts", type=int, default=0, metavar="N",
                   help="keep the first N MoE layers' experts in this process (like llama.cpp --n-cpu-moe)")
    p.add_argument("--transport", choices=["auto", "grpc", "shm"], default="auto")
    p.add_argument("--expert-timeout-s", type=float, default=30.0)
    p.add_argument("--experts-per-token", type=int, default=0, metavar="K",
                   help="routed experts per token (default: the model's own); requests may override it")
    p.add_argument("--reasoning-format", choices=["auto", "none"], default="auto",
                   help="auto: chat replies return the model's reasoning apart from the content (harmony or "
                        "<think> tags, found in the vocabulary); none: reasoning stays inline in the content")
    p.add_argument("--micro-batches", type=int, choices=[1, 2], default=1,
                   help="2: cut each step of several sequences in two and pipeline the halves, so that attention "
                        "of one overlaps the remote experts of the other (MegaScale-Infer's ping-pong); pays where "
                        "halving a batch halves its cost on both sides (large batches), costs where decode is "
                        "bound by weight reads (small batches read every weight twice)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    add_cluster_flags(p, serves=True, calls=True)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import torch

    from attention_service.server import serve
    from attention_service.settings import AttentionSettings
    from splitmoe.settings import otlp_endpoint, setup_logging
    from splitmoe.telemetry import setup_tracing

    if args.model is None:
        from splitmoe.demo_model import demo_model_path

        args.model = str(demo_model_path())
    settings = AttentionSettings(
        model_path=args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
        dtype=args.dtype, device=args.device, kv_cache_tokens=args.kv_cache_tokens,
        max_batch_tokens=args.max_batch_tokens, max_running_seqs=args.max_running,
        max_waiting_requests=args.max_waiting, expert_services=args.expert_services,
        local_expert_layers=args.local_experts, transport=args.transport,
        expert_timeout_s=args.expert_timeout_s, experts_per_token=args.experts_per_token,
        otlp_endpoint=otlp_endpoint(), reasoning_format=args.reasoning_format, micro_batches=args.micro_batches,
        security=cluster_security(args))
    setup_logging()
    if args.threads:
        torch.set_num_threads(args.threads)
    setup_tracing("splitmoe-attention", settings.otlp_endpoint)
    logging.getLogger(__name__).info("starting attention service for %s", settings.model_path)
    asyncio.run(serve(settings))
    return 0
