"""What an architecture declares: its differences over the shared layers, and nothing else."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from splitmoe.attention_service.model.attention import QK_NORM_NONE, MultiHeadAttention
SHARED_EXPERT_NONE, SHARED_EXPERT_PLAIN, SHARED_EXPERT_GATED = "none", "plain", "sigmoid_gated"


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str
    # q/k RMSNorm after projection: per head (Qwen3) or over the whole projection (OLMoE).
    qk_norm: str = QK_NORM_NONE
    # Biases on q/k/v (Qwen2): loaded and required.
    qkv_bias: bool = False
    # Interleaved (GPT-J) rope pairs: llama.cpp's converter permutes Llama/Mixtral q/k rows for it.
    rope_interleaved: bool = False
    shared_expert: str = SHARED_EXPERT_NONE
    # The attention class: loads its weights, declares its KV entries, computes a layer.
    attention: type = MultiHeadAttention
    # ModelConfig values for metadata keys the architecture's files may omit.
    hparam_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Per-head learned logits joining each attention softmax (gpt-oss `attn_sinks.weight`).
    attention_sinks: bool = False
    # In each group of this many layers all but the last use `attention.sliding_window`
    # (llama.cpp's swa pattern); 0: every layer attends to the whole context.
    sliding_window_pattern: int = 0
    # GGUF name of the norm before the FFN: `ffn_norm`, or gpt-oss's `post_attention_norm`.
    ffn_norm: str = "ffn_norm"
