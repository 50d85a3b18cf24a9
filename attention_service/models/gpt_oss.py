"""gpt-oss-20b / 120b: biases everywhere, attention sinks, even layers sliding.

Its experts' clamped SwiGLU and its top-k-then-softmax routing are facts of its files that the
expert service needs too: modelfile/architectures.py (GPT_OSS). The router, output and expert
biases are read wherever the file has them. Rope is NeoX-style YaRN; the file carries no
`truncate` flag, so the correction range is rounded as llama.cpp does.
"""
from splitmoe.attention_service.model.arch_spec import ArchSpec
from splitmoe.modelfile.architectures import GPT_OSS

SPEC = ArchSpec(
    GPT_OSS,
    qkv_bias=True,
    attention_sinks=True,
    sliding_window_pattern=2,
    ffn_norm="post_attention_norm",
)
