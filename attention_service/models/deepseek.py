"""DeepSeek-MoE 16B, GGUF arch `deepseek` (not `deepseek2`): plain multi-head attention.

Interleaved rope (the converter permutes q/k rows as for Llama), leading dense layers, then MoE
layers with `expert_shared_count` plain shared experts. Softmax routing without top-k
renormalisation, which llama.cpp fixes for these files: modelfile/architectures.py (DEEPSEEK).
"""
from splitmoe.attention_service.model.arch_spec import SHARED_EXPERT_PLAIN, ArchSpec
from splitmoe.modelfile.architectures import DEEPSEEK

SPEC = ArchSpec(DEEPSEEK, rope_interleaved=True, shared_expert=SHARED_EXPERT_PLAIN)
