"""gpt-oss-20b / 120b: biases everywhere, attention sinks, even layers sliding, top-k-then-softmax.

The rest of its differences live where they are computed: the clamped SwiGLU of its experts
(modelfile/experts.py picks it by architecture) and the router and expert biases (loaded when
present). Rope is NeoX-style YaRN; the file carries no `truncate` flag, so the correction range
is rounded as llama.cpp does.
"""
from splitmoe.attention_service.models.base import ArchSpec
from splitmoe.modelfile.hparams import GATING_SOFTMAX_WEIGHT

SPEC = ArchSpec(
    gguf_arch="gpt-oss",
    qkv_bias=True,
    attention_sinks=True,
    sliding_window_pattern=2,
    ffn_norm="post_attention_norm",
    hparam_defaults={"expert_gating": GATING_SOFTMAX_WEIGHT, "expert_weights_norm": False},
)
