"""DeepSeek-V2 / V2-Lite / V3 / R1 and Kimi-K2, all GGUF arch `deepseek2`.

MLA attention over a latent KV cache (attention_service/model/mla.py), with its rope part interleaved
(llama.cpp's "norm" rope: DeepSeek's checkpoints keep pairs adjacent and the converter leaves
them so), leading dense layers, plain shared experts. Routing comes from the file: V2 softmax
greedy; V3/Kimi sigmoid + `exp_probs_b` correction bias + grouped top-k + renorm + scale. Older
V2/V2.5 files without `expert_weights_norm` take llama.cpp's default: softmax, not renormalised.
"""
from typing import Any, Mapping

from splitmoe.modelfile.architectures.base import ATTENTION_MLA, SHARED_EXPERT_PLAIN, Architecture, ArchSpec
from splitmoe.modelfile.hparams import MAX_HEAD_DIM, MAX_WIDTH, ModelConfig, Reader


def read_hparams(r: Reader, cfg: ModelConfig) -> Mapping[str, Any]:
    """MLA's q/kv LoRA ranks and each head's key and value dims (ModelConfig's MLA fields)."""
    return {
        "q_lora_rank": r.integer("attention.q_lora_rank", 0, hi=MAX_WIDTH),
        "kv_lora_rank": r.integer("attention.kv_lora_rank", 0, hi=MAX_WIDTH),
        "mla_key_head_dim": r.integer("attention.key_length_mla", 0, hi=MAX_HEAD_DIM),
        "mla_value_head_dim": r.integer("attention.value_length_mla", 0, hi=MAX_HEAD_DIM),
    }


ARCHITECTURE = Architecture("deepseek2", hparam_defaults={"expert_weights_norm": False}, read_hparams=read_hparams)
SPEC = ArchSpec(
    ARCHITECTURE,
    rope_interleaved=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    attention=ATTENTION_MLA,
)
