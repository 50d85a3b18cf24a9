"""DeepSeek-V2 / V2-Lite / V3 / R1 and Kimi-K2, all GGUF arch `deepseek2`.

MLA attention over a latent KV cache (attention_service/model/mla.py), with its rope part interleaved
(llama.cpp's "norm" rope: DeepSeek's checkpoints keep pairs adjacent and the converter leaves
them so), leading dense layers, plain shared experts. Routing comes from the file: V2 softmax
greedy; V3/Kimi sigmoid + `exp_probs_b` correction bias + grouped top-k + renorm + scale; older
files without `expert_weights_norm` take its default from modelfile/architectures.py (DEEPSEEK2).
"""
from splitmoe.attention_service.model.arch_spec import ATTENTION_MLA, SHARED_EXPERT_PLAIN, ArchSpec
from splitmoe.modelfile.architectures import DEEPSEEK2

SPEC = ArchSpec(
    DEEPSEEK2,
    rope_interleaved=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    attention=ATTENTION_MLA,
)
