"""The attention service's settings: parsed once at the edge (the CLI), passed down frozen."""
from __future__ import annotations

from dataclasses import dataclass

from splitmoe.cluster_auth import ClusterSecurity


@dataclass(frozen=True, slots=True)
class AttentionSettings:
    model_path: str
    host: str = "127.0.0.1"
    port: int = 50051
    served_model_name: str = ""  # default: the GGUF file's stem
    dtype: str = "bfloat16"  # the fast path; float32 is the exact reference
    device: str = ""  # default: cuda when present, else cpu
    kv_cache_tokens: int = 16384
    kv_block_tokens: int = 16
    max_batch_tokens: int = 512  # tokens per step: prompt chunks share it with decodes
    max_running_seqs: int = 64
    max_waiting_requests: int = 256
    expert_services: tuple[str, ...] = ()  # host:port of each; none means all experts in-process
    local_expert_layers: int = 0  # the first N MoE layers' experts stay in-process
    transport: str = "auto"  # auto | grpc | shm
    expert_timeout_s: float = 30.0
    experts_per_token: int = 0  # 0: the model's own; fewer trades quality for speed (KTransformers)
    otlp_endpoint: str = ""
    reasoning_format: str = "auto"  # auto: chat replies carry reasoning apart | none: inline, in the content
    # 2: each step of several sequences runs as two pipelined halves, attention of one overlapping
    # the remote experts of the other; pays only where halving a batch halves its cost (see README)
    micro_batches: int = 1
    # The secret its callers must present and that it presents to the expert services; TLS both ways
    security: ClusterSecurity = ClusterSecurity()

    def __post_init__(self):
        if self.transport not in ("auto", "grpc", "shm"):
            raise ValueError(f"transport must be auto, grpc or shm, not {self.transport!r}")
        if self.reasoning_format not in ("auto", "none"):
            raise ValueError(f"reasoning_format must be auto or none, not {self.reasoning_format!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, not {self.dtype!r}")
        if self.micro_batches not in (1, 2):
            raise ValueError(f"micro_batches must be 1 or 2, not {self.micro_batches}")
        if self.max_batch_tokens < 1 or self.max_running_seqs < 1:
            raise ValueError("max_batch_tokens and max_running_seqs must be >= 1")
        self.security.check_listen(self.host)
