"""DeepSeek-V2 / V2-Lite / V3 / R1 and Kimi-K2, all GGUF arch `deepseek2`.

MLA attention over a latent KV cache (attention_service/model/mla.py), with its rope part interleaved
(llama.cpp's "norm" rope: DeepSeek's checkpoints keep pairs adjacent and the converter leaves
them so), leading dense layers, plain shared experts. Routing comes from the file: V2 softmax
greedy; V3/Kimi sigmoid + `exp_probs_b` correction bias + grouped top-k + renorm + scale.
"""
from splitmoe.attention_service.model.mla import MultiLatentAttention
from splitmoe.attention_service.models.base import SHARED_EXPERT_PLAIN, ArchSpec

SPEC = ArchSpec(
    gguf_arch="deepseek2",
    rope_interleaved=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    attention=MultiLatentAttention,
    # llama.cpp's defaults for older V2/V2.5 files without these keys: softmax, not renormalised.
    hparam_defaults={"expert_weights_norm": False},
)
