"""DeepSeek-MoE 16B, GGUF arch `deepseek` (not `deepseek2`): plain multi-head attention.

Interleaved rope (the converter permutes q/k rows as for Llama), leading dense layers, then MoE
layers with `expert_shared_count` plain shared experts. Softmax routing without top-k
renormalisation, which llama.cpp's graph fixes for these files: DeepSeek-MoE's `norm_topk_prob`
has no key.
"""
from splitmoe.modelfile.architectures.base import SHARED_EXPERT_PLAIN, Architecture, ArchSpec

ARCHITECTURE = Architecture("deepseek", hparam_defaults={"expert_weights_norm": False})
SPEC = ArchSpec(ARCHITECTURE, rope_interleaved=True, shared_expert=SHARED_EXPERT_PLAIN)
