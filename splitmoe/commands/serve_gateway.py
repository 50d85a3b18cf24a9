"""`splitmoe serve-gateway`: the OpenAI-compatible HTTP gateway in front of an attention service."""
from __future__ import annotations

import argparse

from splitmoe.commands.cluster_flags import add_api_key_flags, add_cluster_flags, api_key, cluster_security


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-gateway", help="serve the OpenAI-compatible HTTP API in front of an attention service")
    p.add_argument("--attention", required=True, metavar="HOST:PORT", help="the attention service's gRPC address")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    add_api_key_flags(p)
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the model id the attention service reports)")
    p.add_argument("--request-timeout-s", type=float, default=None, help="deadline of one generation (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=None, help="larger request bodies get 413 (default 8 MiB)")
    p.add_argument("--max-generations-per-request", type=int, default=None, metavar="N",
                   help="a request whose prompts x n exceed N gets 400 (default 128)")
    p.add_argument("--max-generations-in-flight", type=int, default=None, metavar="N",
                   help="Generate calls open at once through this gateway; a request that would pass N gets 429 "
                        "(default 512; keep it well under a thousand per attention service, whose gRPC server "
                        "sheds calls at random past that)")
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--no-lora-updates", action="store_true",
                   help="leave out /v1/load_lora_adapter and /v1/unload_lora_adapter (404, as vLLM without "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); the adapters given at start are still served")
    p.add_argument("--health-timeout-s", type=float, default=None,
                   help="what /health and /metrics wait for the attention service at most (default 0.8)")
    add_cluster_flags(p, serves=False, calls=True)
    p.set_defaults(run=cmd_serve_gateway)


def cmd_serve_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from splitmoe.gateway.app import build_app
    from splitmoe.gateway.settings import GatewaySettings
    from splitmoe.runtime.settings import setup_logging
    from splitmoe.runtime.telemetry import setup_tracing

    settings = GatewaySettings.from_env(
        attention_address=args.attention, host=args.host, port=args.port, api_key=api_key(args),
        served_model_name=args.served_model_name, request_timeout_s=args.request_timeout_s,
        max_body_bytes=args.max_body_bytes, max_generations_per_request=args.max_generations_per_request,
        max_generations_in_flight=args.max_generations_in_flight, public_metrics=args.public_metrics or None,
        health_timeout_s=args.health_timeout_s, cluster=cluster_security(args),
        allow_lora_updates=False if args.no_lora_updates else None)
    setup_logging()
    setup_tracing("splitmoe-gateway", settings.otlp_endpoint)
    uvicorn.run(build_app(settings), host=settings.host, port=settings.port, loop="uvloop",
                log_level=settings.log_level, timeout_graceful_shutdown=settings.graceful_shutdown_s)
    return 0

