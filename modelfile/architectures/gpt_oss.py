"""gpt-oss-20b / 120b, GGUF arch `gpt-oss`: biases everywhere, attention sinks, even layers sliding,
the FFN norm named `post_attention_norm`.

Its experts' clamped SwiGLU (kernels.moe ACT_SWIGLU_OAI) and its routing by a softmax over the
top-k raw logits are facts of its files that the expert service needs too. The router, output and
expert biases are read wherever the file has them. Rope is NeoX-style YaRN; the file carries no
`truncate` flag, so the correction range is rounded as llama.cpp does.
"""
from splitmoe.kernels.moe import ACT_SWIGLU_OAI
from splitmoe.modelfile.architectures.base import Architecture, ArchSpec
from splitmoe.modelfile.hparams import GATING_SOFTMAX_WEIGHT

ARCHITECTURE = Architecture("gpt-oss", expert_activation=ACT_SWIGLU_OAI,
                            hparam_defaults={"expert_gating": GATING_SOFTMAX_WEIGHT, "expert_weights_norm": False})
SPEC = ArchSpec(
    ARCHITECTURE,
    qkv_bias=True,
    attention_sinks=True,
    sliding_window_pattern=2,
    ffn_norm="post_attention_norm",
)
