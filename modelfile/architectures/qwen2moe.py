"""Qwen1.5/2-MoE, GGUF arch `qwen2moe`: q/k/v bias, a shared expert behind a sigmoid gate, top-k
weights not renormalised when the file does not say."""
from splitmoe.modelfile.architectures.base import SHARED_EXPERT_GATED, Architecture, ArchSpec

ARCHITECTURE = Architecture("qwen2moe", hparam_defaults={"expert_weights_norm": False})
SPEC = ArchSpec(ARCHITECTURE, qkv_bias=True, shared_expert=SHARED_EXPERT_GATED)
