"""GLM-4.5 / 4.5-Air / 4.6, GGUF arch `glm4moe`: q/k/v bias, per-head q/k norm where the file has
it (GLM-4.5 and 4.6; not 4.5-Air), NeoX rope on the first `rope.dimension_count` dims of each head
(partial rotary), n_head · head_dim ≠ hidden, leading dense layers, a plain shared expert, the FFN
norm named `post_attention_norm`.

Routing comes from the file: sigmoid + `exp_probs_b` correction bias + grouped top-k + renorm +
routed scale, as DeepSeek-V3; sigmoid is llama.cpp's gating when the file names none, and
`expert_feed_forward_length` is required (a default None), as llama.cpp requires it. The NextN/MTP
block a converted GLM-4.5 carries past the last layer (`nextn_predict_layers`: read with the keys
every family shares, since the expert service counts layers too) is skipped at load.
"""
from splitmoe.modelfile.architectures.base import SHARED_EXPERT_PLAIN, Architecture, ArchSpec, QkNorm
from splitmoe.modelfile.hparams import GATING_SIGMOID

ARCHITECTURE = Architecture("glm4moe", hparam_defaults={"expert_gating": GATING_SIGMOID, "expert_weights_norm": False,
                                                        "expert_ffn": None})
SPEC = ArchSpec(
    ARCHITECTURE,
    qk_norm=QkNorm.PER_HEAD,
    qk_norm_optional=True,
    qkv_bias=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    ffn_norm="post_attention_norm",
)
