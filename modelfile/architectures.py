"""What each architecture's GGUF files leave to the code that reads them, for both services.

llama.cpp fixes these per architecture in its C++, not in the file: the routed experts' activation
(its graphs) and the values of metadata keys a file may omit (its hparams loader). They live here,
below both services, because the expert service computes the experts and the attention service
routes to them. Each entry names the file with the rest of its architecture, the attention side
(attention_service/models/<arch>.py), whose ArchSpec names the entry back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from splitmoe.kernels.moe import ACT_SILU, ACT_SWIGLU_OAI
from splitmoe.modelfile.gguf_file import GGUFFile
from splitmoe.modelfile.hparams import GATING_SIGMOID, GATING_SOFTMAX_WEIGHT, NORM_LAYER, ModelConfig


@dataclass(frozen=True)
class Architecture:
    gguf_arch: str
    # The routed experts' act(gate, up) (kernels.moe.ACTIVATIONS).
    expert_activation: str = ACT_SILU
    # ModelConfig values for metadata keys the architecture's files may omit, and for what no key
    # states (the gating, the norm kind), by field name.
    hparam_defaults: Mapping[str, Any] = field(default_factory=dict)

    def config(self, g: GGUFFile) -> ModelConfig:
        return ModelConfig.from_gguf(g, self.hparam_defaults)


# attention_service/models/qwen3moe.py
QWEN3MOE = Architecture("qwen3moe", hparam_defaults={"expert_weights_norm": True})
# attention_service/models/qwen2moe.py
QWEN2MOE = Architecture("qwen2moe", hparam_defaults={"expert_weights_norm": False})
# attention_service/models/mixtral.py. Softmax over all experts, then renormalised top-k: the same as
# softmax over the top-k logits.
MIXTRAL = Architecture("llama", hparam_defaults={"expert_weights_norm": True})
# attention_service/models/olmoe.py
OLMOE = Architecture("olmoe", hparam_defaults={"expert_weights_norm": False})
# attention_service/models/deepseek2.py. llama.cpp's default for older V2/V2.5 files without the key:
# softmax, not renormalised.
DEEPSEEK2 = Architecture("deepseek2", hparam_defaults={"expert_weights_norm": False})
# attention_service/models/gpt_oss.py. Clamped SwiGLU experts (their biases are read wherever a file
# has them), routed by a softmax over the top-k raw logits.
GPT_OSS = Architecture("gpt-oss", expert_activation=ACT_SWIGLU_OAI,
                       hparam_defaults={"expert_gating": GATING_SOFTMAX_WEIGHT, "expert_weights_norm": False})
# attention_service/models/dbrx.py. LayerNorms; softmax routing whose top-k llama.cpp always
# renormalises (the converter writes no key for `moe_normalize_expert_weights`: DBRX's is 1.0);
# `attention.clamp_kqv` required (None), as llama.cpp's reader requires it.
DBRX = Architecture("dbrx", hparam_defaults={"norm": NORM_LAYER, "expert_weights_norm": True, "clamp_kqv": None})
# attention_service/models/deepseek.py (DeepSeek-MoE 16B). llama.cpp's graph fixes softmax without
# renormalisation; DeepSeek-MoE's `norm_topk_prob` has no key.
DEEPSEEK = Architecture("deepseek", hparam_defaults={"expert_weights_norm": False})

# attention_service/models/glm4moe.py. llama.cpp's gating when the file names none: sigmoid. A default
# None: the key is required (here `expert_feed_forward_length`), as llama.cpp requires it.
GLM4MOE = Architecture("glm4moe", hparam_defaults={"expert_gating": GATING_SIGMOID, "expert_weights_norm": False,
                                                   "expert_ffn": None})
# attention_service/models/llama4.py. Sigmoid gating and iRoPE are llama.cpp's constants for it;
# `interleave_moe_layer_step` and `expert_feed_forward_length` are required (None).
LLAMA4 = Architecture("llama4", hparam_defaults={
    "expert_gating": GATING_SIGMOID, "expert_weights_norm": False, "expert_ffn": None, "moe_layer_interval": None,
    "nope_layer_interval": 4,
    "attention_chunk_tokens": 8192, "attention_temperature_floor_tokens": 8192, "attention_temperature_scale": 0.1})

ARCHITECTURES: dict[str, Architecture] = {a.gguf_arch: a for a in (QWEN3MOE, QWEN2MOE, MIXTRAL, OLMOE, DEEPSEEK2,
                                                                   GPT_OSS, DBRX, DEEPSEEK, GLM4MOE, LLAMA4)}


def architecture(gguf_arch: str) -> Architecture:
    """The entry of `gguf_arch`, or the common case (SiLU experts, no defaults) for one not listed:
    the expert service serves any file of the usual tensor layout; the attention side refuses
    architectures it has no ArchSpec for."""
    return ARCHITECTURES.get(gguf_arch) or Architecture(gguf_arch)
