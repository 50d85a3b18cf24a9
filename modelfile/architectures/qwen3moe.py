"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder), GGUF arch `qwen3moe`: per-head q/k norm,
top-k weights renormalised when the file does not say."""
from splitmoe.modelfile.architectures.base import Architecture, ArchSpec, QkNorm

ARCHITECTURE = Architecture("qwen3moe", hparam_defaults={"expert_weights_norm": True})
SPEC = ArchSpec(ARCHITECTURE, qk_norm=QkNorm.PER_HEAD)
