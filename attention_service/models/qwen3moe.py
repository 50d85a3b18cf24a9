"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): per-head q/k norm, renormalised top-k."""
from splitmoe.attention_service.model.attention import QK_NORM_PER_HEAD
from splitmoe.attention_service.models.base import ArchSpec

SPEC = ArchSpec(
    gguf_arch="qwen3moe",
    qk_norm=QK_NORM_PER_HEAD,
    hparam_defaults={"expert_weights_norm": True},
)
