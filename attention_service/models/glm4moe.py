"""GLM-4.5 / 4.5-Air / 4.6, GGUF arch `glm4moe`: q/k/v bias, per-head q/k norm where the file has
it (GLM-4.5 and 4.6; not 4.5-Air), NeoX rope on the first `rope.dimension_count` dims of each head
(partial rotary), n_head · head_dim ≠ hidden, leading dense layers, a plain shared expert, the FFN
norm named `post_attention_norm`.

Routing comes from the file: sigmoid + `exp_probs_b` correction bias + grouped top-k + renorm +
routed scale, as DeepSeek-V3 (sigmoid when the file names no gating: modelfile/architectures.py,
GLM4MOE). The NextN/MTP block a converted GLM-4.5 carries past the last layer is skipped at load.
"""
from splitmoe.attention_service.model.arch_spec import QK_NORM_PER_HEAD, SHARED_EXPERT_PLAIN, ArchSpec
from splitmoe.modelfile.architectures import GLM4MOE

SPEC = ArchSpec(
    GLM4MOE,
    qk_norm=QK_NORM_PER_HEAD,
    qk_norm_optional=True,
    qkv_bias=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    ffn_norm="post_attention_norm",
)
