"""Qwen1.5/2-MoE: q/k/v bias, top-k weights not renormalised, shared expert behind a sigmoid gate."""
from splitmoe.attention_service.models.base import SHARED_EXPERT_GATED, ArchSpec

SPEC = ArchSpec(
    gguf_arch="qwen2moe",
    qkv_bias=True,
    shared_expert=SHARED_EXPERT_GATED,
    hparam_defaults={"expert_weights_norm": False},
)
