"""Hyper-parameters of a GGUF model, read once from its `<arch>.*` metadata keys."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from modelfile.gguf_file import GGUFError, GGUFFile

GATING_SOFTMAX, GATING_SIGMOID = "softmax", "sigmoid"
GATING_SOFTMAX_WEIGHT = "softmax_weight"  # softmax over the chosen top-k logits only (gpt-oss)
_GATING_BY_CODE = {1: GATING_SOFTMAX, 2: GATING_SIGMOID}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str  # "linear" or "yarn"
    factor: float
    original_context_tokens: int
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_multiplier: float = 0.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    vocab_size: int
    context_tokens: int
    norm_eps: float
    rope_theta: float
    rope_dims: int
    rope_scaling: RopeScaling | None
    dense_ffn: int
    num_experts: int
    num_experts_used: int
    expert_ffn: int
    shared_expert_ffn: int
    num_leading_dense_layers: int
    expert_gating: str
    expert_weights_norm: bool
    expert_weights_scale: float
    sliding_window_tokens: int
    # MLA (deepseek2): q/kv LoRA ranks (q 0: no q LoRA, as V2-Lite) and each head's key (no-rope
    # + rope) and value dims, which the file's key/value_length (the absorbed MQA view) are not.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    mla_key_head_dim: int = 0
    mla_value_head_dim: int = 0
    # Grouped top-k (DeepSeek-V3): only experts of the best `num_expert_groups_used` groups compete.
    num_expert_groups: int = 0
    num_expert_groups_used: int = 0

    @classmethod
    def from_gguf(cls, g: GGUFFile, defaults: Mapping[str, Any] | None = None) -> "ModelConfig":
        """`defaults` are the architecture's values for keys its files may omit (by field name)."""
        defaults = dict(defaults or {})
        unknown = set(defaults) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig defaults: {sorted(unknown)}")

        def opt(key: str, field: str, fallback: Any) -> Any:
            return g.arch_get(key, defaults.get(field, fallback))

        hidden = int(g.arch_require("embedding_length"))
        heads = int(g.arch_require("attention.head_count"))
        head_dim = int(g.arch_get("attention.key_length", hidden // heads))
        dense_ffn = int(g.arch_get("feed_forward_length", 0))
        num_experts = int(g.arch_get("expert_count", 0))
        return cls(
            arch=g.arch,
            num_layers=int(g.arch_require("block_count")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(g.arch_get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            value_head_dim=int(g.arch_get("attention.value_length", head_dim)),
            vocab_size=_vocab_size(g),
            context_tokens=int(g.arch_get("context_length", 4096)),
            norm_eps=float(g.arch_get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(opt("rope.freq_base", "rope_theta", 10000.0)),
            rope_dims=int(g.arch_get("rope.dimension_count", head_dim)),
            rope_scaling=_rope_scaling(g),
            dense_ffn=dense_ffn,
            num_experts=num_experts,
            num_experts_used=int(g.arch_require("expert_used_count")) if num_experts else 0,
            expert_ffn=int(g.arch_get("expert_feed_forward_length", dense_ffn)),
            shared_expert_ffn=_shared_expert_ffn(g, defaults),
            num_leading_dense_layers=int(g.arch_get("leading_dense_block_count", 0)),
            expert_gating=_gating(g, defaults),
            expert_weights_norm=bool(opt("expert_weights_norm", "expert_weights_norm", False)),
            expert_weights_scale=float(opt("expert_weights_scale", "expert_weights_scale", 1.0)),
            sliding_window_tokens=int(g.arch_get("attention.sliding_window", 0)),
            q_lora_rank=int(g.arch_get("attention.q_lora_rank", 0)),
            kv_lora_rank=int(g.arch_get("attention.kv_lora_rank", 0)),
            mla_key_head_dim=int(g.arch_get("attention.key_length_mla", 0)),
            mla_value_head_dim=int(g.arch_get("attention.value_length_mla", 0)),
            num_expert_groups=int(g.arch_get("expert_group_count", 0)),
            num_expert_groups_used=int(g.arch_get("expert_group_used_count", 0)),
        )


def _vocab_size(g: GGUFFile) -> int:
    size = g.arch_get("vocab_size")
    if size is None:
        size = len(g.require("tokenizer.ggml.tokens"))
    return int(size)


def _shared_expert_ffn(g: GGUFFile, defaults: Mapping[str, Any]) -> int:
    explicit = g.arch_get("expert_shared_feed_forward_length")
    if explicit is not None:
        return int(explicit)
    # DeepSeek states a count of shared experts, each as wide as a routed one.
    count = int(g.arch_get("expert_shared_count", 0))
    return count * int(g.arch_get("expert_feed_forward_length", 0)) or int(defaults.get("shared_expert_ffn", 0))


def _gating(g: GGUFFile, defaults: Mapping[str, Any]) -> str:
    code = g.arch_get("expert_gating_func")
    if code is None:
        return defaults.get("expert_gating", GATING_SOFTMAX)
    if int(code) not in _GATING_BY_CODE:
        raise GGUFError(f"{g.path.name}: {g.arch}.expert_gating_func = {code} is not supported")
    return _GATING_BY_CODE[int(code)]


def _rope_scaling(g: GGUFFile) -> RopeScaling | None:
    kind = g.arch_get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        raise GGUFError(f"{g.path.name}: {g.arch}.rope.scaling.type = {kind!r} is not supported")
    return RopeScaling(
        kind=kind,
        factor=float(g.arch_require("rope.scaling.factor")),
        original_context_tokens=int(g.arch_get("rope.scaling.original_context_length", 0)),
        yarn_beta_fast=float(g.arch_get("rope.scaling.yarn_beta_fast", 32.0)),
        yarn_beta_slow=float(g.arch_get("rope.scaling.yarn_beta_slow", 1.0)),
        yarn_log_multiplier=float(g.arch_get("rope.scaling.yarn_log_multiplier", 0.0)),
    )
