"""What an architecture module (modelfile/architectures/<family>.py) fills in: its file facts
(`Architecture`, which both services read) and the choices the attention side's shared layers leave
to it (`ArchSpec`).

Kinds are named by value (an enum, or a string constant), so this module imports no layer and every
layer may import it; the layers map each kind to its code (attention_service/model/attention_kinds.py
for the attention classes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from splitmoe.kernels.decode_layer import QkNorm
from splitmoe.kernels.moe import ACT_SILU
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import FamilyHparams, ModelConfig

__all__ = ["ATTENTION_IROPE", "ATTENTION_MHA", "ATTENTION_MLA", "SHARED_EXPERT_GATED", "SHARED_EXPERT_NONE",
           "SHARED_EXPERT_PLAIN", "ArchSpec", "Architecture", "QkNorm"]

SHARED_EXPERT_NONE, SHARED_EXPERT_PLAIN, SHARED_EXPERT_GATED = "none", "plain", "sigmoid_gated"
# Multi-head attention with grouped KV heads (attention.py); multi-head latent attention (mla.py);
# Llama 4's iRoPE: the former with NoPE, chunked and temperature-tuned layers (irope.py).
ATTENTION_MHA, ATTENTION_MLA, ATTENTION_IROPE = "mha", "mla", "irope"

_KINDS = {"shared_expert": (SHARED_EXPERT_NONE, SHARED_EXPERT_PLAIN, SHARED_EXPERT_GATED),
          "attention": (ATTENTION_MHA, ATTENTION_MLA, ATTENTION_IROPE)}


@dataclass(frozen=True)
class Architecture:
    """What an architecture's GGUF files leave to the code that reads them, for both services.

    llama.cpp fixes these per architecture in its C++, not in the file: the routed experts'
    activation (its graphs), the values of metadata keys a file may omit and the keys only that
    family has (its hparams loader). The expert service needs them too: it computes the experts."""
    gguf_arch: str
    # The routed experts' act(gate, up) (kernels.moe.ACTIVATIONS).
    expert_activation: str = ACT_SILU
    # ModelConfig values for metadata keys the architecture's files may omit, and for what no key
    # states (the gating, the norm kind), by field name. A default None: the key is required.
    hparam_defaults: Mapping[str, Any] = field(default_factory=dict)
    # The keys only this family has (MLA, iRoPE, the clamp): read after the common ones, returning
    # the ModelConfig fields they set (modelfile/hparams.py `FamilyHparams`).
    read_hparams: FamilyHparams | None = None

    def config(self, g: GGUFFile) -> ModelConfig:
        return ModelConfig.from_gguf(g, self.hparam_defaults, self.read_hparams)


@dataclass(frozen=True)
class ArchSpec:
    """The attention side's wiring of the shared layers for one architecture."""
    # What its files leave out that the expert service needs too: expert activation, metadata defaults.
    architecture: Architecture
    # q/k RMSNorm after projection: per head (Qwen3) or over the whole projection (OLMoE).
    qk_norm: QkNorm = QkNorm.NONE
    # The q/k norm only where the file has it (GLM-4.5 has it, 4.5-Air not); otherwise required.
    qk_norm_optional: bool = False
    # Biases on q/k/v (Qwen2): loaded and required.
    qkv_bias: bool = False
    # q, k and v stored as one `attn_qkv` weight, rows q | k | v (DBRX): split by rows at load.
    fused_qkv: bool = False
    # Interleaved (GPT-J) rope pairs: llama.cpp's converter permutes Llama/Mixtral q/k rows for it.
    rope_interleaved: bool = False
    shared_expert: str = SHARED_EXPERT_NONE
    # The attention kind: its class loads the weights, declares the KV entries, computes a layer.
    attention: str = ATTENTION_MHA
    # Per-head learned logits joining each attention softmax (gpt-oss `attn_sinks.weight`).
    attention_sinks: bool = False
    # In each group of this many layers all but the last use `attention.sliding_window`
    # (llama.cpp's swa pattern); 0: every layer attends to the whole context.
    sliding_window_pattern: int = 0
    # GGUF name of the norm before the FFN: `ffn_norm`, or gpt-oss's `post_attention_norm`.
    ffn_norm: str = "ffn_norm"
    # The router's weight scales each expert's input, not its output (Llama 4).
    expert_input_weighted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.qk_norm, QkNorm):
            raise ValueError(f"{self.gguf_arch}: qk_norm {self.qk_norm!r}: want a QkNorm")
        for name, kinds in _KINDS.items():
            if getattr(self, name) not in kinds:
                raise ValueError(f"{self.gguf_arch}: {name} {getattr(self, name)!r}: want one of {', '.join(kinds)}")
        if self.sliding_window_pattern < 0:
            raise ValueError(f"{self.gguf_arch}: sliding_window_pattern must be >= 0")

    @property
    def gguf_arch(self) -> str:
        return self.architecture.gguf_arch
