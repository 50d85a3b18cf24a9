"""Hyper-parameters of a GGUF model, read once from its `<arch>.*` metadata keys, and checked.

Every value must have its GGUF type and lie in bounds, and related values must agree, before any
of them sizes an allocation: a corrupt or hostile `head_count_kv = 2^31-1` is a one-line error
naming the key, not a KV cache of terabytes. The bounds are far beyond any released model; the
tensors' shapes are then checked against these values where each tensor is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Mapping

from splitmoe.modelfile.gguf_file import GGUFError, GGUFFile

GATING_SOFTMAX, GATING_SIGMOID = "softmax", "sigmoid"
GATING_SOFTMAX_WEIGHT = "softmax_weight"  # softmax over the chosen top-k logits only (gpt-oss)
_GATING_BY_CODE = {1: GATING_SOFTMAX, 2: GATING_SIGMOID}
# The norm every layer and the output use: RMSNorm, or LayerNorm without bias (DBRX), each with its
# own epsilon key. No file states it: llama.cpp's graph for the architecture does.
NORM_RMS, NORM_LAYER = "rms", "layer"

# A family's reading of the keys only it has (MLA, iRoPE, the clamp): the ModelConfig fields it sets,
# given the fields every family shares (modelfile/architectures/<family>.py).
FamilyHparams = Callable[["Reader", "ModelConfig"], Mapping[str, Any]]

# The largest released models have ~128 layers, 16k-wide embeddings, 128 heads, 512 experts,
# 262k-token vocabularies and 10M-token contexts.
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 17  # embedding, FFN and LoRA widths
MAX_HEADS = 1024
MAX_HEAD_DIM = 1 << 13
MAX_EXPERTS = 4096
MAX_VOCAB = 1 << 22
MAX_CONTEXT = 1 << 26


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
    # MLA (deepseek2.py): q/kv LoRA ranks (q 0: no q LoRA, as V2-Lite) and each head's key (no-rope
    # + rope) and value dims, which the file's key/value_length (the absorbed MQA view) are not.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    mla_key_head_dim: int = 0
    mla_value_head_dim: int = 0
    # Grouped top-k (DeepSeek-V3): only experts of the best `num_expert_groups_used` groups compete.
    num_expert_groups: int = 0
    num_expert_groups_used: int = 0
    norm: str = NORM_RMS
    # q, k and v clamped to [-clamp_kqv, clamp_kqv] after projection (dbrx.py); 0: not clamped.
    clamp_kqv: float = 0.0
    # GLM-4.5's NextN/MTP blocks: the last `nextn_predict_layers` of `block_count`, which the main
    # forward pass does not run (num_layers counts only the others).
    num_nextn_layers: int = 0
    # Llama 4 (llama4.py): layer i is MoE when (i + 1) % moe_layer_interval == 0 (0: the file's routers decide).
    moe_layer_interval: int = 0
    # Llama 4's iRoPE (llama.cpp hard-codes it: no GGUF key; see llama4.py). Layer i has no rope
    # when (i + 1) % nope_layer_interval == 0; the others attend within chunks of
    # attention_chunk_tokens; NoPE layers scale q by log(floor((pos + 1) / floor) + 1) * scale + 1.
    nope_layer_interval: int = 0
    attention_chunk_tokens: int = 0
    attention_temperature_floor_tokens: int = 0
    attention_temperature_scale: float = 0.0

    @property
    def num_blocks(self) -> int:
        """The file's `block_count`: the main layers and the NextN/MTP ones after them (per-layer
        tables that the MTP drafter's layer also reaches are this long)."""
        return self.num_layers + self.num_nextn_layers

    @classmethod
    def from_gguf(cls, g: GGUFFile, defaults: Mapping[str, Any] | None = None,
                  read_family: FamilyHparams | None = None) -> "ModelConfig":
        """`defaults` are the architecture's values for keys its files may omit (by field name), and
        `read_family` reads the keys only its family has: modelfile/architectures/<family>.py, whose
        `Architecture.config` passes both. Without them, the keys every family shares."""
        defaults = dict(defaults or {})
        unknown = set(defaults) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig defaults: {sorted(unknown)}")
        r = Reader(g)
        norm = defaults.get("norm", NORM_RMS)
        hidden = r.integer("embedding_length", lo=1, hi=MAX_WIDTH)
        heads = r.integer("attention.head_count", lo=1, hi=MAX_HEADS)
        head_dim = r.integer("attention.key_length", hidden // heads, lo=1, hi=MAX_HEAD_DIM)
        num_kv_heads = r.integer("attention.head_count_kv", heads, lo=1, hi=heads)
        if heads % num_kv_heads:
            r.fail("attention.head_count_kv", num_kv_heads, f"does not divide attention.head_count = {heads}")
        block_count = r.integer("block_count", lo=1, hi=MAX_LAYERS)
        num_nextn = r.integer("nextn_predict_layers", 0, hi=block_count - 1)
        num_layers = block_count - num_nextn
        dense_ffn = r.integer("feed_forward_length", 0, hi=MAX_WIDTH)
        num_experts = r.integer("expert_count", 0, hi=MAX_EXPERTS)
        num_groups = r.integer("expert_group_count", 0, hi=num_experts)
        if num_groups and num_experts % num_groups:
            r.fail("expert_group_count", num_groups, f"does not divide expert_count = {num_experts}")
        cfg = cls(
            arch=g.arch,
            num_layers=num_layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            value_head_dim=r.integer("attention.value_length", head_dim, lo=1, hi=MAX_HEAD_DIM),
            vocab_size=_vocab_size(g, r),
            context_tokens=r.integer("context_length", 4096, lo=1, hi=MAX_CONTEXT),
            norm_eps=_norm_eps(r, norm),
            rope_theta=r.positive("rope.freq_base", defaults.get("rope_theta", 10000.0)),
            rope_dims=r.integer("rope.dimension_count", head_dim, lo=2, hi=head_dim, multiple_of=2),
            rope_scaling=_rope_scaling(r),
            dense_ffn=dense_ffn,
            num_experts=num_experts,
            num_experts_used=r.integer("expert_used_count", lo=1, hi=num_experts) if num_experts else 0,
            expert_ffn=r.integer("expert_feed_forward_length", defaults.get("expert_ffn", dense_ffn), hi=MAX_WIDTH),
            shared_expert_ffn=_shared_expert_ffn(r, defaults),
            num_leading_dense_layers=r.integer("leading_dense_block_count", 0, hi=num_layers),
            expert_gating=_gating(r, defaults),
            expert_weights_norm=r.flag("expert_weights_norm", defaults.get("expert_weights_norm", False)),
            expert_weights_scale=r.positive("expert_weights_scale", defaults.get("expert_weights_scale", 1.0)),
            sliding_window_tokens=r.integer("attention.sliding_window", 0, hi=MAX_CONTEXT),
            num_expert_groups=num_groups,
            num_expert_groups_used=r.integer("expert_group_used_count", 0, hi=num_groups),
            norm=norm,
            # Here, not in glm4moe.py: the expert service counts layers without knowing architectures.
            num_nextn_layers=num_nextn,
        )
        return replace(cfg, **read_family(r, cfg)) if read_family else cfg


class Reader:
    """`<arch>.<key>` values of their GGUF type and within bounds; anything else fails naming the key.

    A default stands for an absent key and is held to the same bounds: one derived from other
    keys (key_length from embedding_length / head_count) can be out of them too.
    """

    def __init__(self, g: GGUFFile):
        self.g = g

    def integer(self, key: str, default: int | None = None, *, lo: int = 0, hi: int, multiple_of: int = 1) -> int:
        value = self.g.arch_value(key, int) if default is None else self.g.arch_value(key, int, default)
        if not lo <= value <= hi:
            self.fail(key, value, f"is out of range: must lie in [{lo}, {hi}]")
        if value % multiple_of:
            self.fail(key, value, f"is not a multiple of {multiple_of}")
        return value

    def positive(self, key: str, default: float | None = None, *, below: float = math.inf) -> float:
        value = self.g.arch_value(key, float) if default is None else self.g.arch_value(key, float, default)
        if not 0 < value < below:  # NaN fails this too
            self.fail(key, value, "must be positive" + (f" and below {below:g}" if below < math.inf else "")
                      + " and finite")
        return value

    def non_negative(self, key: str, default: float | None) -> float:
        value = self.g.arch_value(key, float) if default is None else self.g.arch_value(key, float, default)
        if not 0 <= value < math.inf:
            self.fail(key, value, "must be >= 0 and finite")
        return value

    def finite(self, key: str, default: float) -> float:
        value = self.g.arch_value(key, float, default)
        if not math.isfinite(value):
            self.fail(key, value, "must be finite")
        return value

    def flag(self, key: str, default: bool) -> bool:
        return self.g.arch_value(key, bool, default)

    def text(self, key: str) -> str | None:
        return self.g.arch_value(key, str, None)

    def fail(self, key: str, value: Any, why: str) -> None:
        absent = "" if self.g.get(f"{self.g.arch}.{key}") is not None else " (absent from the file: its default)"
        raise GGUFError(f"{self.g.path.name}: metadata key '{self.g.arch}.{key}' = {value}{absent} {why}")


def _norm_eps(r: Reader, norm: str) -> float:
    if norm == NORM_LAYER:  # llama.cpp requires the key of these files
        return r.positive("attention.layer_norm_epsilon", below=1.0)
    if norm != NORM_RMS:
        raise ValueError(f"norm {norm!r}: want {NORM_RMS} or {NORM_LAYER}")
    return r.positive("attention.layer_norm_rms_epsilon", 1e-6, below=1.0)


def _vocab_size(g: GGUFFile, r: Reader) -> int:
    if g.arch_get("vocab_size") is not None:
        return r.integer("vocab_size", lo=1, hi=MAX_VOCAB)
    size = len(g.value("tokenizer.ggml.tokens", list))
    if not 1 <= size <= MAX_VOCAB:
        raise GGUFError(f"{g.path.name}: metadata key 'tokenizer.ggml.tokens' holds {size} tokens, "
                        f"must be 1 to {MAX_VOCAB}")
    return size


def _shared_expert_ffn(r: Reader, defaults: Mapping[str, Any]) -> int:
    explicit = r.integer("expert_shared_feed_forward_length", 0, hi=MAX_WIDTH)
    if explicit:
        return explicit
    # DeepSeek states a count of shared experts, each as wide as a routed one.
    count = r.integer("expert_shared_count", 0, hi=MAX_EXPERTS)
    width = r.integer("expert_feed_forward_length", 0, hi=MAX_WIDTH)
    return count * width or int(defaults.get("shared_expert_ffn", 0))


def _gating(r: Reader, defaults: Mapping[str, Any]) -> str:
    code = r.integer("expert_gating_func", 0, hi=2**64 - 1)
    if code == 0:  # absent, or llama.cpp's "none": the architecture's own
        return defaults.get("expert_gating", GATING_SOFTMAX)
    if code not in _GATING_BY_CODE:
        r.fail("expert_gating_func", code, "is not supported (1: softmax, 2: sigmoid)")
    return _GATING_BY_CODE[code]


def _rope_scaling(r: Reader) -> RopeScaling | None:
    kind = r.text("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind not in ("linear", "yarn"):
        r.fail("rope.scaling.type", repr(kind), "is not supported (none, linear and yarn are)")
    # YaRN's correction range takes logs of the original context over each beta.
    original = r.integer("rope.scaling.original_context_length", 0, lo=int(kind == "yarn"), hi=MAX_CONTEXT)
    return RopeScaling(
        kind=kind,
        factor=r.positive("rope.scaling.factor"),
        original_context_tokens=original,
        yarn_beta_fast=r.positive("rope.scaling.yarn_beta_fast", 32.0),
        yarn_beta_slow=r.positive("rope.scaling.yarn_beta_slow", 1.0),
        yarn_log_multiplier=r.finite("rope.scaling.yarn_log_multiplier", 0.0),
    )
