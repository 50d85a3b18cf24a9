"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder): per-head q/k norm.

Renormalised top-k by default: modelfile/architectures.py (QWEN3MOE).
"""
from splitmoe.attention_service.model.arch_spec import QK_NORM_PER_HEAD, ArchSpec
from splitmoe.modelfile.architectures import QWEN3MOE

SPEC = ArchSpec(QWEN3MOE, qk_norm=QK_NORM_PER_HEAD)
