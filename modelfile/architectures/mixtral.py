"""Mixtral 8x7B / 8x22B, stored as GGUF arch `llama` with experts: top-2 of 8, interleaved rope.

Softmax over all experts, then renormalised top-k (the default when the file does not say): the
same as a softmax over the top-k logits.
"""
from splitmoe.modelfile.architectures.base import Architecture, ArchSpec

ARCHITECTURE = Architecture("llama", hparam_defaults={"expert_weights_norm": True})
SPEC = ArchSpec(ARCHITECTURE, rope_interleaved=True)
