"""Mixtral 8x7B / 8x22B, stored as GGUF arch `llama` with experts: top-2 of 8, interleaved rope."""
from splitmoe.attention_service.models.base import ArchSpec

SPEC = ArchSpec(
    gguf_arch="llama",
    rope_interleaved=True,
    # Softmax over all experts, then renormalised top-k: the same as softmax over the top-k logits.
    hparam_defaults={"expert_weights_norm": True},
)
