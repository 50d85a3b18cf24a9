"""Llama-4 Scout / Maverick, GGUF arch `llama4`: iRoPE attention (attention_service/model/irope.py:
NoPE every 4th layer with attention temperature, chunked attention with interleaved rope and an
L2 q/k norm on the others), MoE every `interleave_moe_layer_step`-th layer with a plain shared
expert, top-1 sigmoid routing whose weight scales the expert's input.

llama.cpp hard-codes the iRoPE numbers (NoPE interval 4, chunk 8192, temperature floor 8192 and
scale 0.1): modelfile/architectures.py (LLAMA4), read in modelfile/hparams.py `_irope`, where
SplitMoE's own `llama4.splitmoe.*` keys (never written by a converter) can replace them for tests.
"""
from splitmoe.attention_service.model.arch_spec import ATTENTION_IROPE, SHARED_EXPERT_PLAIN, ArchSpec
from splitmoe.modelfile.architectures import LLAMA4

SPEC = ArchSpec(
    LLAMA4,
    rope_interleaved=True,
    shared_expert=SHARED_EXPERT_PLAIN,
    attention=ATTENTION_IROPE,
    expert_input_weighted=True,
)
