"""Qwen1.5/2-MoE: q/k/v bias, shared expert behind a sigmoid gate.

Top-k weights not renormalised by default: modelfile/architectures.py (QWEN2MOE).
"""
from splitmoe.attention_service.model.arch_spec import SHARED_EXPERT_GATED, ArchSpec
from splitmoe.modelfile.architectures import QWEN2MOE

SPEC = ArchSpec(QWEN2MOE, qkv_bias=True, shared_expert=SHARED_EXPERT_GATED)
