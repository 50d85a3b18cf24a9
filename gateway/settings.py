"""The gateway's settings: parsed once at the edge (CLI + environment), read-only after.

This is the only gateway module that reads the environment (process-wide variables through
splitmoe.runtime.settings); everything else gets a `GatewaySettings`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitmoe.runtime import settings as process_settings
from splitmoe.runtime.cluster_auth import ClusterSecurity

# The fallback of --api-key (llama-server reads LLAMA_API_KEY the same way).
ENV_API_KEY = "SPLITMOE_API_KEY"


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    attention_address: str                 # HOST:PORT of the attention service's gRPC server
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = field(default=None, repr=False)  # None: no authentication on /v1/*
    served_model_name: str | None = None   # None: the model_id the attention service reports
    request_timeout_s: float = 600.0       # deadline of one Generate/Score call (whole generation)
    probe_timeout_s: float = 5.0           # deadline of ModelInfo/GetStats (health, metrics, /v1/models)
    health_timeout_s: float = 0.8          # what /health and /metrics wait at most: a probe answers in a second
    max_body_bytes: int = 8 << 20          # larger request bodies get 413 before they are parsed
    max_generations_per_request: int = 128  # prompts x n above this get 400 (OpenAI's n goes up to 128)
    max_generations_in_flight: int = 512   # Generate calls open at once; a request past it gets 429
    public_metrics: bool = False           # True: /metrics answers without the API key
    allow_lora_updates: bool = True        # /v1/load_lora_adapter and /v1/unload_lora_adapter (False: 404)
    graceful_shutdown_s: float = 30.0      # in-flight requests get this long to finish on SIGTERM
    otlp_endpoint: str | None = None
    log_level: str = "info"
    cluster: ClusterSecurity = ClusterSecurity()  # the secret (and TLS) of calls to the attention service

    def __post_init__(self) -> None:
        if ":" not in self.attention_address:
            raise ValueError(f"attention address must be HOST:PORT, got {self.attention_address!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must lie in [0, 65535], got {self.port}")
        for name in ("request_timeout_s", "probe_timeout_s", "health_timeout_s", "max_body_bytes", "max_generations_per_request",
                     "max_generations_in_flight"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **values) -> "GatewaySettings":
        """Settings from explicit values (the CLI), falling back to the environment for unset ones."""
        env = os.environ if environ is None else environ
        values = {k: v for k, v in values.items() if v is not None}
        values.setdefault("api_key", env.get(ENV_API_KEY) or None)
        values.setdefault("otlp_endpoint", process_settings.otlp_endpoint() or None)
        values.setdefault("log_level", process_settings.log_level().lower())
        return cls(**values)
